"""Transformer-block ops: fused bias + GeLU, scaled masked softmax, rotary position embedding.

    y = bias_gelu(x, bias=None, approximate="none"|"tanh")        # gelu(x + bias), bias (D,) or None
    p = scaled_masked_softmax(scores, mask=None, scale=1.0)       # softmax(scores * scale), mask True = masked out
    q = apply_rotary(q, cos, sin)                                 # q * cos + rotate_half(q) * sin (HF Llama)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # transformers' function, same signature

Each has a compiled forward and backward (autograd registered with ``torch.library.register_autograd``) and a
``*_reference`` beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_zero.ops._native import native_available, warn_fallback

__all__ = [
    "apply_rotary",
    "apply_rotary_pos_emb",
    "apply_rotary_reference",
    "bias_gelu",
    "bias_gelu_reference",
    "rotate_half",
    "scaled_masked_softmax",
    "scaled_masked_softmax_reference",
]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_native(x: torch.Tensor, op: str) -> bool:
    if x.dtype not in _KERNEL_DTYPES:
        return False
    if native_available(x.device):
        return True
    warn_fallback(op, x.device)
    return False


# ---------------------------------------------------------------- references


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    z = x.float() if bias is None else x.float() + bias.float()
    return F.gelu(z, approximate=approximate).to(x.dtype)


def scaled_masked_softmax_reference(x: torch.Tensor, mask: torch.Tensor | None = None,
                                    scale: float = 1.0) -> torch.Tensor:
    scores = x.float() * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:  # rows with every position masked: zeros, not NaN
        probs = probs.masked_fill(mask.expand(x.shape).all(dim=-1, keepdim=True), 0.0)
    return probs.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (rotate_half(x) * sin)


# ---------------------------------------------------------------- public ops


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if not _use_native(x, "bias_gelu"):
        return bias_gelu_reference(x, bias, approximate)
    return torch.ops.hf_zero.bias_gelu(x, bias, approximate)


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"scaled_masked_softmax: mask must be a bool tensor (True = masked out), got {mask.dtype}")
    if not _use_native(x, "scaled_masked_softmax"):
        return scaled_masked_softmax_reference(x, mask, scale)
    return torch.ops.hf_zero.scaled_masked_softmax(x, mask, float(scale))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.dtype not in (torch.float32, x.dtype) or sin.dtype != cos.dtype or not _use_native(x, "apply_rotary"):
        return apply_rotary_reference(x, cos, sin)
    return torch.ops.hf_zero.apply_rotary(x, cos, sin)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (Llama family), on the fused kernel."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


# ---------------------------------------------------------------- fake kernels and autograd


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum a broadcast gradient back to the shape (and dtype) of the operand that was broadcast."""
    lead = grad.dim() - like.dim()
    if lead > 0:
        grad = grad.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(like.shape) if n == 1 and grad.shape[i] != 1)
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.to(like.dtype)


def _register() -> None:
    def like(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("hf_zero::bias_gelu")
    def _(x, bias, approximate):
        return like(x)

    @torch.library.register_fake("hf_zero::bias_gelu_bwd")
    def _(grad_out, x, bias, approximate):
        return like(x)

    @torch.library.register_fake("hf_zero::scaled_masked_softmax")
    def _(x, mask, scale):
        return like(x)

    @torch.library.register_fake("hf_zero::scaled_softmax_bwd")
    def _(grad_out, out, scale):
        return like(out)

    @torch.library.register_fake("hf_zero::apply_rotary")
    def _(x, cos, sin):
        torch._check(x.shape[-1] % 2 == 0, lambda: "apply_rotary: the last dimension of x must be even")
        return like(x)

    @torch.library.register_fake("hf_zero::apply_rotary_bwd")
    def _(grad_out, cos, sin):
        return like(grad_out)

    def gelu_setup(ctx, inputs, output):
        x, bias, approximate = inputs
        ctx.approximate = approximate
        ctx.save_for_backward(x, bias)

    def gelu_backward(ctx, grad_out):
        x, bias = ctx.saved_tensors
        dz = torch.ops.hf_zero.bias_gelu_bwd(grad_out.contiguous(), x, bias, ctx.approximate)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            dbias = dz.float().reshape(-1, dz.shape[-1]).sum(0).to(bias.dtype)
        return dz, dbias, None

    torch.library.register_autograd("hf_zero::bias_gelu", gelu_backward, setup_context=gelu_setup)

    def softmax_setup(ctx, inputs, output):
        ctx.scale = inputs[2]
        ctx.save_for_backward(output)

    def softmax_backward(ctx, grad_out):
        (out,) = ctx.saved_tensors
        return torch.ops.hf_zero.scaled_softmax_bwd(grad_out.contiguous(), out, ctx.scale), None, None

    torch.library.register_autograd("hf_zero::scaled_masked_softmax", softmax_backward, setup_context=softmax_setup)

    def rotary_setup(ctx, inputs, output):
        x, cos, sin = inputs
        # x is needed only for the (rare) gradient of the cos/sin tables.
        ctx.save_for_backward(x if (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]) else None, cos, sin)

    def rotary_backward(ctx, grad_out):
        x, cos, sin = ctx.saved_tensors
        dx = torch.ops.hf_zero.apply_rotary_bwd(grad_out.contiguous(), cos, sin) if ctx.needs_input_grad[0] else None
        dcos = _reduce_to(grad_out * x, cos) if ctx.needs_input_grad[1] else None
        dsin = _reduce_to(grad_out * rotate_half(x), sin) if ctx.needs_input_grad[2] else None
        return dx, dcos, dsin

    torch.library.register_autograd("hf_zero::apply_rotary", rotary_backward, setup_context=rotary_setup)


if native_available("cpu"):
    _register()
