"""Adagrad over CPU tensors: the compiled ``hf_zero::adagrad_step`` kernel, its pure-PyTorch reference, and
``CPUAdagrad`` (DeepSpeed's ``DeepSpeedCPUAdagrad``: same constructor, same update, same state keys).

The update is torch.optim.Adagrad's with ``lr_decay=0`` and ``initial_accumulator_value=0``::

    g = grad / grad_scale + weight_decay * p;   v += g * g;   p -= lr * g / (sqrt(v) + eps)

Dispatch: the compiled CPU kernel for contiguous fp32 CPU tensors, ``adagrad_step_reference`` otherwise (with
the one-time fallback warning of :mod:`hf_zero.ops._native` when the kernel is missing).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from hf_zero.ops._native import native_available, stale_build_warning, warn_fallback

__all__ = ["CPUAdagrad", "adagrad_step_", "adagrad_step_reference"]

_FLOAT16 = (torch.bfloat16, torch.float16)


def adagrad_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
                           eps: float, weight_decay: float, grad_scale: float = 1.0,
                           out16: torch.Tensor | None = None) -> None:
    """Pure-PyTorch reference of :func:`adagrad_step_` (torch.optim.Adagrad's arithmetic)."""
    g = grad.reshape(param.shape).float()
    if grad_scale != 1.0:
        g = g / grad_scale
    if weight_decay != 0.0:
        g = g + weight_decay * param
    exp_avg_sq.addcmul_(g.reshape(exp_avg_sq.shape), g.reshape(exp_avg_sq.shape), value=1.0)
    std = exp_avg_sq.sqrt().add_(eps)
    param.addcdiv_(g, std.reshape(param.shape), value=-lr)
    if out16 is not None:
        out16.copy_(param.reshape(out16.shape))


def adagrad_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float, eps: float,
                  weight_decay: float, grad_scale: float = 1.0, out16: torch.Tensor | None = None) -> None:
    """One Adagrad step in place on ``param`` and ``exp_avg_sq`` (fp32); ``grad`` fp32/bf16/fp16; ``out16`` gets
    the updated parameter in 16 bit."""
    if param.device.type == "cpu" and _compiled():
        if param.dtype == torch.float32 and all(t is None or t.is_contiguous() for t in (param, exp_avg_sq, out16)) \
                and exp_avg_sq.dtype == torch.float32:
            torch.ops.hf_zero.adagrad_step(param, grad, exp_avg_sq, out16, float(lr), float(eps),
                                           float(weight_decay), float(grad_scale))
            return
    elif param.device.type == "cpu":
        if native_available("cpu"):
            stale_build_warning("adagrad_step")
        else:
            warn_fallback("adagrad_step", param.device)
    adagrad_step_reference(param, grad, exp_avg_sq, lr=lr, eps=eps, weight_decay=weight_decay,
                           grad_scale=grad_scale, out16=out16)


class CPUAdagrad(torch.optim.Optimizer):
    """Adagrad over CPU parameters with the compiled kernel; constructor of DeepSpeed's DeepSpeedCPUAdagrad.

    fp32 parameters are updated in place; 16-bit parameters through an fp32 copy written back in 16 bit. The
    state ``exp_avg_sq`` (the sum of squared gradients) is fp32 (``fp32_optimizer_states=True``) or the
    parameter's dtype.
    """

    # hf_zero.runtime.optimizers: a client optimizer of this class updates each element from that element alone,
    # so it gives the same result on a ZeRO shard as on the full tensor
    hf_zero_elementwise = True

    def __init__(self, model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-2,
                 eps: float = 1e-10, weight_decay: float = 0.0, amsgrad: bool = False,
                 fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("CPUAdagrad does not support amsgrad=True (neither does DeepSpeedCPUAdagrad)")
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"CPUAdagrad: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CPUAdagrad does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                state["step"] += 1
                kwargs = dict(lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"])
                v = state["exp_avg_sq"]
                if p.dtype == torch.float32 and v.dtype == torch.float32:
                    adagrad_step_(p.data, p.grad, v, **kwargs)
                    continue
                master, v32 = p.data.float(), v.float()
                adagrad_step_(master, p.grad, v32, out16=p.data if p.dtype in _FLOAT16 else None, **kwargs)
                if p.dtype not in _FLOAT16:
                    p.data.copy_(master)
                if v32.data_ptr() != v.data_ptr():
                    v.copy_(v32)
        return loss


def _register() -> None:
    @torch.library.register_fake("hf_zero::adagrad_step")
    def _(param, grad, exp_avg_sq, out16, lr, eps, weight_decay, grad_scale):
        torch._check(param.dtype == torch.float32, lambda: "adagrad_step: param must be float32")
        torch._check(grad.numel() == param.numel(), lambda: "adagrad_step: grad and param differ in numel")
        return None


@functools.cache
def _compiled() -> bool:
    """The kernel is in the loaded extension (an extension built before this op existed lacks it)."""
    return native_available("cpu") and hasattr(torch.ops.hf_zero, "adagrad_step")


if _compiled():
    _register()
