"""Hook plumbing, through public PyTorch APIs only. The policy (what to gather when) is in runtime.py.

Per module with partitioned parameters, one forward call goes through::

    forward pre-hook    gather the module's group; wrap the inputs that require grad in _PostBackward
    forward hook        release the group; register a grad hook on every output tensor that requires grad
    output grad hook    (first one to fire) pre-backward: gather the group again        -- before its backward
    _PostBackward.bwd   post-backward: release the group                                -- after its backward
    post-accumulate     per parameter: hand the finished gradient to the reducer

and the end of a backward pass is signalled with ``Variable._execution_engine.queue_callback``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .states import ModuleCall

__all__ = ["PostBackward", "wrap_inputs_for_post_backward", "register_output_grad_hooks",
           "install_module_hooks", "outside_graph", "queue_end_of_backward"]


def outside_graph(hook: Callable) -> Callable:
    """``hook`` as torch.compile must see it: run eagerly, between compiled graphs. The hooks gather, release and
    swap ``param.data``, wrap inputs in an autograd Function and talk to other ranks -- none of which can be traced
    into a graph; each compiled region then starts with its module's parameters gathered. Eager runs call it as
    before (the wrapper costs one Python call)."""
    return torch.compiler.disable(hook, recursive=True)


class PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the gradients w.r.t. those inputs exist, i.e. after
    the module's own backward. ``on_post_backward(call)`` is then called."""

    @staticmethod
    def forward(ctx, on_post_backward: Callable, call: ModuleCall, *inputs: torch.Tensor):
        ctx.on_post_backward, ctx.call = on_post_backward, call
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.on_post_backward(ctx.call)
        return (None, None) + grads


def _visit_tensors(obj: Any, fn: Callable[[torch.Tensor], None]) -> None:
    """Call ``fn`` on every tensor inside tuples, lists and dicts (ModelOutput is a dict)."""
    if isinstance(obj, torch.Tensor):
        fn(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _visit_tensors(o, fn)
    elif isinstance(obj, dict):
        for o in obj.values():
            _visit_tensors(o, fn)


def wrap_inputs_for_post_backward(args: tuple, kwargs: dict, on_post_backward: Callable,
                                  call: ModuleCall) -> tuple[tuple, dict] | None:
    """Route the top-level input tensors that require grad through :class:`PostBackward`. None if there are none."""
    positions: list[tuple[str, Any]] = []
    tensors: list[torch.Tensor] = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            positions.append(("a", i))
            tensors.append(a)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            positions.append(("k", k))
            tensors.append(v)
    if not tensors:
        return None
    wrapped = PostBackward.apply(on_post_backward, call, *tensors)
    args = list(args)
    kwargs = dict(kwargs)
    for (kind, where), t in zip(positions, wrapped):
        if kind == "a":
            args[where] = t
        else:
            kwargs[where] = t
    return tuple(args), kwargs


def register_output_grad_hooks(output: Any, on_pre_backward: Callable, call: ModuleCall | None) -> None:
    """The first of these hooks to fire runs ``on_pre_backward(call)``: the module's backward is about to start."""

    def visit(t: torch.Tensor) -> None:
        if t.requires_grad and t.grad_fn is not None:
            t.register_hook(lambda grad: on_pre_backward(call))

    _visit_tensors(output, visit)


def install_module_hooks(module: nn.Module, pre_forward: Callable, post_forward: Callable) -> list[RemovableHandle]:
    """``pre_forward(module, args, kwargs) -> (args, kwargs) | None`` runs before every other pre-hook, so user
    hooks already see full parameters; ``post_forward(module, args, output)``."""
    return [module.register_forward_pre_hook(outside_graph(pre_forward), prepend=True, with_kwargs=True),
            module.register_forward_hook(outside_graph(post_forward))]


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)
