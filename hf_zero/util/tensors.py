"""Small tensor helpers that DeepSpeed scripts import by DeepSpeed's names (the shim forwards to them)."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["move_to_device", "functorch_transforming"]


def move_to_device(item: Any, device, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """``deepspeed.runtime.utils.move_to_device``: ``item`` -- a tensor, or lists, tuples and dicts of them -- on
    ``device``. A tensor for which ``criterion_func`` holds is moved in place (its ``.data`` rebound, so every holder
    of it sees the move) and returned; any other tensor is returned as a copy on ``device`` (``.to``), as in
    DeepSpeed, where the criterion only chooses in place or not. Containers are rebuilt of the same type."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.data.to(device)
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def functorch_transforming() -> bool:
    """Whether a torch.func transform (grad, vjp, jacrev, vmap) is running now: its interpreter stack is not empty.
    (DeepSpeed's ``is_functorch_transforming`` asks the same.)"""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
