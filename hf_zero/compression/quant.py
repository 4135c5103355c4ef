"""Uniform integer quantization of float tensors: the one definition used by QAT, post-training quantization
and export, so a folded or exported weight equals what the fake-quantized model computed.

Layout: every function works on a 2-D view ``(G, n)`` -- one scale (and zero point) per row ``g``. How a weight
is cut into groups is :func:`group_view`'s job: per tensor ``(1, numel)``, per output channel ``(out, in)``, or
per group of ``group_size`` consecutive input features ``(out * in / group_size, group_size)``.
"""

from __future__ import annotations

import torch

__all__ = ["qrange", "quantize", "dequantize", "fake_quant", "group_view", "GroupSpec"]

_EPS = 1e-12


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """Integer range of the codes: symmetric ``[-(2^(b-1)-1), 2^(b-1)-1]`` (no -2^(b-1), so 0 stays centered);
    asymmetric ``[0, 2^b - 1]``."""
    if symmetric:
        m = 2 ** (bits - 1) - 1
        return -m, m
    return 0, 2**bits - 1


def quantize(x: torch.Tensor, bits: int, symmetric: bool, stochastic: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``: (G, n) float. Returns integer codes (G, n) as float, scale (G, 1), zero point (G, 1)."""
    qmin, qmax = qrange(bits, symmetric)
    x = x.detach()
    if symmetric:
        scale = (x.abs().amax(dim=1, keepdim=True) / qmax).clamp_min(_EPS)
        zero = torch.zeros_like(scale)
    else:
        lo = x.amin(dim=1, keepdim=True).clamp_max(0.0)  # keep 0 exactly representable (padding, masks)
        hi = x.amax(dim=1, keepdim=True).clamp_min(0.0)
        scale = ((hi - lo) / (qmax - qmin)).clamp_min(_EPS)
        zero = torch.round(-lo / scale)
    scaled = x / scale
    if stochastic:
        scaled = torch.floor(scaled + torch.rand_like(scaled))
    else:
        scaled = torch.round(scaled)
    codes = torch.clamp(scaled + zero, qmin, qmax)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (codes - zero) * scale


def fake_quant(x: torch.Tensor, bits: int, symmetric: bool, stochastic: bool = False) -> torch.Tensor:
    """Quantize-dequantize ``x`` (G, n) with a straight-through gradient: forward is the grid value, backward is
    the identity (the rounding has no useful gradient)."""
    codes, scale, zero = quantize(x, bits, symmetric, stochastic)
    q = dequantize(codes, scale, zero).to(x.dtype)
    return x + (q - x).detach()


class GroupSpec:
    """How a weight of shape (out, in) is cut into quantization groups."""

    def __init__(self, *, quantize_groups: int = 1, per_channel: bool = False, group_size: int | None = None):
        self.quantize_groups = quantize_groups
        self.per_channel = per_channel
        self.group_size = group_size

    def check(self, shape: torch.Size) -> str | None:
        """Why this spec cannot cut a weight of ``shape`` into groups, or None."""
        numel = shape.numel()
        if self.group_size is not None:
            if shape[-1] % self.group_size:
                return f"group_size {self.group_size} does not divide in_features {shape[-1]}"
        elif not self.per_channel and numel % self.quantize_groups:
            return f"quantize_groups {self.quantize_groups} does not divide the weight's {numel} elements"
        return None

    def describe(self) -> str:
        if self.group_size is not None:
            return f"group{self.group_size}"
        if self.per_channel:
            return "channel"
        return "tensor" if self.quantize_groups == 1 else f"{self.quantize_groups}groups"


def group_view(w: torch.Tensor, spec: GroupSpec) -> torch.Tensor:
    """(out, in) -> (G, n) view, row-major, so groups are contiguous runs of a row (or of the flat weight)."""
    if spec.group_size is not None:
        return w.reshape(-1, spec.group_size)
    if spec.per_channel:
        return w.reshape(w.shape[0], -1)
    return w.reshape(spec.quantize_groups, -1)
