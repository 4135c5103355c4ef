"""``fp16.auto_cast``: the engine casts the floating-point tensors among the forward's positional inputs to float16.

As DeepSpeed 0.19.8 (``_cast_inputs_half`` in its forward pre-hook): lists, tuples and dicts among the positional
arguments are walked recursively; integer and bool tensors (token ids, masks) and non-tensors pass unchanged.
Keyword arguments are passed as given -- DeepSpeed casts only the positional ones -- so a model called as
``engine(**batch)`` (the Hugging Face Trainer's way) gets its tensors as the batch holds them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cast_inputs_half"]


def cast_inputs_half(inputs: Any) -> Any:
    """``inputs`` with every floating-point tensor in it as float16; containers are rebuilt, not changed in place."""
    if isinstance(inputs, torch.Tensor):
        return inputs.half() if inputs.is_floating_point() else inputs
    if isinstance(inputs, tuple) and hasattr(inputs, "_fields"):  # a namedtuple takes its fields positionally
        return type(inputs)(*(cast_inputs_half(v) for v in inputs))
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(cast_inputs_half(v) for v in inputs)
    if isinstance(inputs, dict):
        return {k: cast_inputs_half(v) for k, v in inputs.items()}
    return inputs
