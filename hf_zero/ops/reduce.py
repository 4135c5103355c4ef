"""``hf_zero::sum_of_squares``: sum(t.float() ** 2) over every element of t, as a 0-dim fp32 tensor.

    sq = sum_of_squares(grad_shard)   # (N,) fp32 | bf16 | fp16 -> () fp32

The engine's global gradient norm is the square root of the (all-reduced) sum of these over the gradient shards.
torch's ``vector_norm(t, 2, dtype=torch.float32)`` converts bf16 element by element on CPUs without AVX512-BF16
(about 110 ms for 16.8M elements on AVX2); the compiled kernel reads 16-bit data at memory speed, accumulates in
fp32 lanes flushed into double, and gives the same result for any number of threads. inf and nan in ``t`` come
out as inf / nan, which is how the caller detects fp16 overflow.
"""

from __future__ import annotations

import torch

from hf_zero.ops._native import native_available, warn_fallback

__all__ = ["sum_of_squares", "sum_of_squares_reference"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sum_of_squares_reference(t: torch.Tensor) -> torch.Tensor:
    return t.float().square().sum()


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _KERNEL_DTYPES:
        return sum_of_squares_reference(t)
    if native_available(t.device):
        return torch.ops.hf_zero.sum_of_squares(t)
    warn_fallback("sum_of_squares", t.device)
    return sum_of_squares_reference(t)


def _register() -> None:
    @torch.library.register_fake("hf_zero::sum_of_squares")
    def _(t):
        return t.new_empty((), dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, grad_out):
        (t,) = ctx.saved_tensors
        return (2.0 * grad_out * t.float()).to(t.dtype)

    torch.library.register_autograd("hf_zero::sum_of_squares", backward, setup_context=setup_context)


if native_available("cpu"):
    _register()
