"""LayerNorm and RMSNorm over the last dimension, and their fused residual-add variants.

    out = layer_norm(x, weight, bias, eps)                          # (..., D) -> (..., D)
    out = rms_norm(x, weight, eps)                                  # transformers' LlamaRMSNorm
    out, x_plus_residual = add_layer_norm(x, residual, weight, bias, eps)
    out, x_plus_residual = add_rms_norm(x, residual, weight, eps)

fp32, bf16 and fp16 inputs; statistics are accumulated in fp32 and the output is rounded once to x's dtype.
Forward and backward are compiled (``hf_zero::*_fwd`` / ``*_bwd``); autograd is registered with
``torch.library.register_autograd``. The ``*_reference`` functions beside them are the pure-PyTorch semantics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_zero.ops._native import native_available, warn_fallback

__all__ = [
    "add_layer_norm",
    "add_layer_norm_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------- references


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         eps: float = 1e-5) -> torch.Tensor:
    D = x.shape[-1]
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (D,), w, b, eps).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


def add_layer_norm_reference(x, residual, weight, bias, eps=1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return layer_norm_reference(s, weight, bias, eps), s


def add_rms_norm_reference(x, residual, weight, eps=1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


# ---------------------------------------------------------------- public ops


def _use_native(x: torch.Tensor, weight: torch.Tensor | None, op: str) -> bool:
    if x.dtype not in _KERNEL_DTYPES or (weight is not None and weight.dtype not in _KERNEL_DTYPES):
        return False
    if native_available(x.device):
        return True
    warn_fallback(op, x.device)
    return False


def _ones(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return weight if weight is not None else x.new_ones(x.shape[-1])


def _zeros(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return bias if bias is not None else x.new_zeros(x.shape[-1])


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    if not _use_native(x, weight, "layer_norm_fwd"):
        return layer_norm_reference(x, weight, bias, eps)
    out, _, _ = torch.ops.hf_zero.layer_norm_fwd(x, _ones(x, weight), _zeros(x, bias), float(eps))
    return out


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape != residual.shape or x.dtype != residual.dtype or not _use_native(x, weight, "add_layer_norm_fwd"):
        return add_layer_norm_reference(x, residual, weight, bias, eps)
    out, s, _, _ = torch.ops.hf_zero.add_layer_norm_fwd(x, residual, _ones(x, weight), _zeros(x, bias), float(eps))
    return out, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    # A weight of another dtype promotes the output in LlamaRMSNorm (weight * normed); the kernel keeps x's dtype.
    if (weight is not None and weight.dtype != x.dtype) or not _use_native(x, weight, "rms_norm_fwd"):
        return rms_norm_reference(x, weight, eps)
    out, _ = torch.ops.hf_zero.rms_norm_fwd(x, _ones(x, weight), float(eps))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    if (x.shape != residual.shape or x.dtype != residual.dtype or (weight is not None and weight.dtype != x.dtype)
            or not _use_native(x, weight, "add_rms_norm_fwd")):
        return add_rms_norm_reference(x, residual, weight, eps)
    out, s, _ = torch.ops.hf_zero.add_rms_norm_fwd(x, residual, _ones(x, weight), float(eps))
    return out, s


# ---------------------------------------------------------------- fake kernels and autograd


def _register() -> None:
    def stats(x):
        return x.new_empty(x.shape[:-1], dtype=torch.float32)

    def check(x, weight):
        torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1],
                     lambda: f"norm: weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")

    @torch.library.register_fake("hf_zero::layer_norm_fwd")
    def _(x, weight, bias, eps):
        check(x, weight)
        return torch.empty_like(x, memory_format=torch.contiguous_format), stats(x), stats(x)

    @torch.library.register_fake("hf_zero::add_layer_norm_fwd")
    def _(x, residual, weight, bias, eps):
        check(x, weight)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return out, torch.empty_like(out), stats(x), stats(x)

    @torch.library.register_fake("hf_zero::layer_norm_bwd")
    def _(grad_out, x, mean, rstd, weight):
        return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
                torch.empty_like(weight))

    @torch.library.register_fake("hf_zero::rms_norm_fwd")
    def _(x, weight, eps):
        check(x, weight)
        return torch.empty_like(x, memory_format=torch.contiguous_format), stats(x)

    @torch.library.register_fake("hf_zero::add_rms_norm_fwd")
    def _(x, residual, weight, eps):
        check(x, weight)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        return out, torch.empty_like(out), stats(x)

    @torch.library.register_fake("hf_zero::rms_norm_bwd")
    def _(grad_out, x, rstd, weight):
        return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)

    # LayerNorm: saved (x or x+residual, weight, mean, rstd); mean/rstd outputs carry no gradient.
    def ln_setup(ctx, inputs, output):
        x, weight = inputs[0], inputs[1]
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, mean, rstd)

    def ln_backward(ctx, grad_out, _grad_mean, _grad_rstd):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = torch.ops.hf_zero.layer_norm_bwd(grad_out.contiguous(), x, mean, rstd, weight)
        return dx, dw, db, None

    torch.library.register_autograd("hf_zero::layer_norm_fwd", ln_backward, setup_context=ln_setup)

    def add_ln_setup(ctx, inputs, output):
        _, s, mean, rstd = output
        ctx.save_for_backward(s, inputs[2], mean, rstd)

    def add_ln_backward(ctx, grad_out, grad_sum, _grad_mean, _grad_rstd):
        s, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = torch.ops.hf_zero.layer_norm_bwd(grad_out.contiguous(), s, mean, rstd, weight)
        dx = dx + grad_sum  # x + residual also flows on through the residual stream
        return dx, dx, dw, db, None

    torch.library.register_autograd("hf_zero::add_layer_norm_fwd", add_ln_backward, setup_context=add_ln_setup)

    def rms_setup(ctx, inputs, output):
        _, rstd = output
        ctx.save_for_backward(inputs[0], inputs[1], rstd)

    def rms_backward(ctx, grad_out, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.hf_zero.rms_norm_bwd(grad_out.contiguous(), x, rstd, weight)
        return dx, dw, None

    torch.library.register_autograd("hf_zero::rms_norm_fwd", rms_backward, setup_context=rms_setup)

    def add_rms_setup(ctx, inputs, output):
        _, s, rstd = output
        ctx.save_for_backward(s, inputs[2], rstd)

    def add_rms_backward(ctx, grad_out, grad_sum, _grad_rstd):
        s, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.hf_zero.rms_norm_bwd(grad_out.contiguous(), s, rstd, weight)
        dx = dx + grad_sum
        return dx, dx, dw, None

    torch.library.register_autograd("hf_zero::add_rms_norm_fwd", add_rms_backward, setup_context=add_rms_setup)


if native_available("cpu"):
    _register()
