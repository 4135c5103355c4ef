"""The two collectives of Megatron-style tensor parallelism, as autograd functions on plain (local) tensors.

    copy_to_tp(x)      forward: identity          backward: all-reduce (sum) over the TP group
    reduce_from_tp(x)  forward: all-reduce (sum)  backward: identity

A column-parallel linear's input is whole on every TP rank and each rank's input gradient covers only its output
columns: ``copy_to_tp`` sums those partial gradients. A row-parallel linear's (or the vocabulary-sharded
embedding's) output is a partial sum on each rank: ``reduce_from_tp`` sums it; its gradient is already whole.
These replace DTensor's per-op dispatch in the sharded layers' compute (layers.py): one Python-level autograd node
per collective instead of a sharding propagation per op.

:class:`SharedCopy` lets the column-parallel projections that read one tensor (q / k / v, gate / up) share one
``copy_to_tp`` node: autograd sums their gradients into that node's output before its backward runs, so the
backward issues one all-reduce per block input instead of one per projection (Megatron places the copy at the
block's input for the same reason).

Each collective is issued under hf_zero's watchdog (``comm.faults.bounded``: a stopped or dead peer ends the job
with a diagnosed error instead of a hang). The per-collective divergence check (a header all-gather) is not run
here: these collectives sit in every layer's forward and backward, in an order fixed by the model's code, and a
check each would double their synchronisation points -- the checked collectives around them (gradient reduction,
the loss) catch ranks that run different models or batches.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from hf_zero.comm import faults

__all__ = ["copy_to_tp", "reduce_from_tp", "SharedCopy"]


def _all_reduce(t: torch.Tensor, group, what: str) -> torch.Tensor:
    with faults.bounded(what, group):
        dist.all_reduce(t, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # a new tensor object for autograd to attach its node to; no copy

    @staticmethod
    def backward(ctx, grad):
        # a copy: autograd may hand the same gradient tensor to another branch (an add's two inputs)
        return _all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group,
                           "the tensor-parallel all-reduce of a column-parallel input's gradient"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous()
        if y is x:
            ctx.mark_dirty(x)  # reduced in place: x is the fresh output of the caller's matmul / lookup
        return _all_reduce(y, group, "the tensor-parallel all-reduce of a row-parallel output")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` (whole on every TP rank) entering a column-parallel region: see the module docstring."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x  # nothing flows back: the backward all-reduce would never run
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the TP group of each rank's partial ``x``: see the module docstring. ``x`` may be reduced in
    place: pass the fresh result of a matmul or lookup, nothing another tensor views."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _ReduceFromTP.apply(x, group)
    return _all_reduce(x.contiguous(), group, "the tensor-parallel all-reduce of a row-parallel output")


class SharedCopy:
    """One ``copy_to_tp`` node per input tensor, shared by the column-parallel layers of one TP group that read it.

    Remembers the last input (by weak reference) and its copy: a layer called with the very tensor object the
    previous one got reuses that copy. The copy is held only while the input's Python object lives (the copy's
    own Python object would die as soon as the first projection returns: autograd saves tensors, not Python
    objects). Only the last input is remembered: the projections of one block are called back to back on it.
    """

    def __init__(self, group) -> None:
        self.group = group
        self._last: tuple[weakref.ref, torch.Tensor] | None = None

    def _forget(self, ref: weakref.ref) -> None:
        if self._last is not None and self._last[0] is ref:
            self._last = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        if self._last is not None and self._last[0]() is x:
            return self._last[1]
        copied = _CopyToTP.apply(x, self.group)
        self._last = (weakref.ref(x, self._forget), copied)
        return copied
