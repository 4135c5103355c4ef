"""``hf_zero::scale_add``: out = x + alpha * y.

The smallest op, kept to prove the whole path end to end (install-time build, load, dispatch, fake kernel,
autograd, fallback) and to give `hf-zero doctor` a cheap smoke test.
"""

from __future__ import annotations

import torch

from hf_zero.ops._native import native_available, warn_fallback

__all__ = ["scale_add", "scale_add_reference"]


def scale_add_reference(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return x + alpha * y


def scale_add(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    if native_available(x.device):
        return torch.ops.hf_zero.scale_add(x, y, float(alpha))
    warn_fallback("scale_add", x.device)
    return scale_add_reference(x, y, alpha)


def _register() -> None:
    @torch.library.register_fake("hf_zero::scale_add")
    def _(x, y, alpha):
        torch._check(x.shape == y.shape, lambda: f"scale_add: shapes differ: {x.shape} vs {y.shape}")
        torch._check(x.dtype == y.dtype, lambda: f"scale_add: dtypes differ: {x.dtype} vs {y.dtype}")
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def setup_context(ctx, inputs, output):
        ctx.alpha = inputs[2]

    def backward(ctx, grad_out):
        return grad_out, grad_out * ctx.alpha, None

    torch.library.register_autograd("hf_zero::scale_add", backward, setup_context=setup_context)


if native_available("cpu"):
    _register()
