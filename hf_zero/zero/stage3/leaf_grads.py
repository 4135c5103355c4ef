"""Gradients of ZeRO-3 leaf modules: reduced together, once the leaf's backward is over (DeepSpeed's rule).

Outside leaves a gradient is reduce-scattered as soon as autograd accumulates it, so every rank must produce the
same gradients in the same order -- a parameter used on one rank and not on another stops the job with the
divergence error. A leaf module is where a model may legitimately differ between ranks: a mixture-of-experts block
routes each rank's tokens to different experts, a module may pick a branch by rank. So the gradients of a leaf's
parameters are held as they arrive, and when the leaf's backward ends every trainable parameter of the leaf is
reduced, in one fixed order, with zeros for those this rank did not use: the same collectives on every rank, and
the average over ranks DeepSpeed computes (its ``reduce_leaf_module_grads``).

The end of a leaf's backward is the backward of :class:`~hf_zero.zero.stage3.hooks.PostBackward` around its inputs
(torch runs a parameter's AccumulateGrad before any other ready node, so the leaf's gradients are in by then). A
leaf call whose inputs need no gradient (the first module of a model) has no such point; its gradients are reduced
at the end of the backward pass instead, which is equally the same point on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from .hooks import outside_graph, wrap_inputs_for_post_backward
from .param import ShardedParam

__all__ = ["LeafGradients", "unused_gradient"]


def unused_gradient(sp: ShardedParam) -> torch.Tensor:
    """The gradient a leaf's parameter counts with on a rank whose forward did not use it: zeros, in the dtype and
    on the device a real one would have, so every rank packs the same buckets."""
    return torch.zeros(sp.numel, dtype=sp.dtype, device=sp.data.device)


class LeafGradients:
    """Owns, for each leaf module, its trainable parameters and the gradients held for them until the flush."""

    def __init__(self, reduce: Callable[[ShardedParam, torch.Tensor], None],
                 done: Callable[[ShardedParam], None], active: Callable[[], bool]) -> None:
        self._reduce = reduce  # hands one full gradient to the reducer
        self._done = done      # a parameter's gradient is accounted for (the runtime's bookkeeping after a grad)
        # False while the runtime holds every gradient itself (coalesce_grad_reduction), leaves included
        self._active = active
        self._leaf_of: dict[int, nn.Module] = {}           # ds_id -> its leaf module
        self._members: dict[nn.Module, list[ShardedParam]] = {}  # leaf -> trainable params, in ds_id order
        self._held: dict[nn.Module, dict[int, torch.Tensor]] = {}
        self._at_end: dict[nn.Module, None] = {}           # leaves flushed at the end of the backward pass
        self._handles: list = []

    def rebuild(self, leaves: dict[nn.Module, list[ShardedParam]]) -> None:
        """The current leaves and their parameters (after the leaf flags changed): hooks on exactly those."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.clear()
        trainable = {leaf: sorted((sp for sp in sps if sp.requires_grad), key=lambda sp: sp.ds_id)
                     for leaf, sps in leaves.items()}
        self._members = {leaf: sps for leaf, sps in trainable.items() if sps}
        self._leaf_of = {sp.ds_id: leaf for leaf, sps in self._members.items() for sp in sps}
        for leaf in self._members:
            self._handles.append(leaf.register_forward_pre_hook(outside_graph(self._pre_forward), with_kwargs=True))

    def remove(self) -> None:
        self.rebuild({})

    def hold(self, sp: ShardedParam, grad: torch.Tensor) -> bool:
        """Keep ``grad`` until its leaf's flush; False when ``sp`` is in no leaf (reduce it now)."""
        leaf = self._leaf_of.get(sp.ds_id)
        if leaf is None:
            return False
        held = self._held.setdefault(leaf, {})
        previous = held.get(sp.ds_id)
        held[sp.ds_id] = grad if previous is None else previous.add_(grad)  # a parameter used twice in the leaf
        return True

    def members(self) -> list[ShardedParam]:
        return [sp for sps in self._members.values() for sp in sps]

    def finish_backward(self) -> None:
        """End of the backward pass: flush the leaves that had no other end point, then anything still held (a
        leaf whose backward was cut short), so no gradient is lost."""
        for leaf in list(self._at_end):
            self._flush(leaf)
        self._at_end.clear()
        for leaf in [leaf for leaf, held in self._held.items() if held]:
            self._flush(leaf)

    def clear(self) -> None:
        self._held.clear()
        self._at_end.clear()

    # ---------------------------------------------------------------- hooks
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if not (self._active() and torch.is_grad_enabled() and module in self._members):
            return None
        wrapped = wrap_inputs_for_post_backward(args, kwargs, self._on_post_backward, module)
        if wrapped is None:
            self._at_end[module] = None
        return wrapped

    def _on_post_backward(self, leaf: nn.Module) -> None:
        self._flush(leaf)

    def _flush(self, leaf: nn.Module) -> None:
        held = self._held.pop(leaf, {})
        for sp in self._members.get(leaf, ()):
            grad = held.pop(sp.ds_id, None)
            if grad is None:  # not used by this rank's forward: its share of the average is zero
                grad = unused_gradient(sp)
                self._done(sp)
            self._reduce(sp, grad)
            del grad
