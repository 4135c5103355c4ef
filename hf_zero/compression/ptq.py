"""Weight-only post-training quantization: no training, no data. Each selected linear weight is replaced (in place)
by its quantize-dequantize value on the given grid -- the same grid QAT uses -- so the model keeps running as a
float model while its weights hold at most ``2**bits`` values per group; :func:`~hf_zero.compression.export_int8`
or :func:`~hf_zero.compression.export_bnb` then store them compactly."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from .quant import GroupSpec, dequantize, group_view, quantize

__all__ = ["quantize_weights"]


@torch.no_grad()
def quantize_weights(model: nn.Module, bits: int = 8, *, symmetric: bool = True, per_channel: bool = True,
                     group_size: int | None = None, modules: Iterable[str] = ("*",),
                     skip: Iterable[str] = ()) -> dict[str, int]:
    """Round every selected ``nn.Linear`` weight to ``bits``. Returns {module name: bits}."""
    if not 2 <= bits <= 16:
        raise ValueError(f"bits must be between 2 and 16, got {bits}")
    spec = GroupSpec(per_channel=per_channel, group_size=group_size)
    patterns, skip = list(modules), list(skip)
    done: dict[str, int] = {}
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) and name):
            continue
        if not any(p == "*" or re.search(p, name) for p in patterns) or any(re.search(s, name) for s in skip):
            continue
        problem = spec.check(module.weight.shape)
        if problem:
            raise ValueError(f"{name}: {problem}")
        w = module.weight
        codes, scale, zero = quantize(group_view(w.float(), spec), bits, symmetric)
        w.copy_(dequantize(codes, scale, zero).view_as(w).to(w.dtype))
        done[name] = bits
    if not done:
        raise ValueError(f"quantize_weights: modules={patterns} matched no torch.nn.Linear in {type(model).__name__}")
    return done
