"""Adagrad over CPU tensors: the compiled ``hf_zero::adagrad_step`` kernel, its pure-PyTorch reference, and
``CPUAdagrad`` (DeepSpeed's ``DeepSpeedCPUAdagrad``: same constructor, same update, same state keys).

The update is torch.optim.Adagrad's with ``lr_decay=0`` and ``initial_accumulator_value=0``::

    g = grad / grad_scale + weight_decay * p;   v += g * g;   p -= lr * g / (sqrt(v) + eps)

Dispatch: the compiled CPU kernel for contiguous fp32 CPU tensors, ``adagrad_step_reference`` otherwise (with
the one-time fallback warning of :mod:`hf_zero.ops._native` when the kernel is missing).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hf_zero.ops._optim_common import StateStepOptimizer, cpu_kernel_ready, kernel_in_build

__all__ = ["CPUAdagrad", "adagrad_step_", "adagrad_step_reference"]


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
    if cpu_kernel_ready("adagrad_step", param, (exp_avg_sq,), out16):
        torch.ops.hf_zero.adagrad_step(param, grad, exp_avg_sq, out16, float(lr), float(eps), float(weight_decay),
                                       float(grad_scale))
        return
    adagrad_step_reference(param, grad, exp_avg_sq, lr=lr, eps=eps, weight_decay=weight_decay,
                           grad_scale=grad_scale, out16=out16)


class CPUAdagrad(StateStepOptimizer):
    """Adagrad over CPU parameters with the compiled kernel; constructor of DeepSpeed's DeepSpeedCPUAdagrad.

    fp32 parameters are updated in place; 16-bit parameters through an fp32 copy written back in 16 bit. The
    state ``exp_avg_sq`` (the sum of squared gradients) is fp32 (``fp32_optimizer_states=True``) or the
    parameter's dtype.
    """

    # hf_zero.runtime.optimizers: a client optimizer of this class updates each element from that element alone,
    # so it gives the same result on a ZeRO shard as on the full tensor
    hf_zero_elementwise = True
    STATE_KEYS = ("exp_avg_sq",)  # DeepSpeedCPUAdagrad's name for torch.optim.Adagrad's "sum"
    _kernel = staticmethod(adagrad_step_)

    def __init__(self, model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-2,
                 eps: float = 1e-10, weight_decay: float = 0.0, amsgrad: bool = False,
                 fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("CPUAdagrad does not support amsgrad=True (neither does DeepSpeedCPUAdagrad)")
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"CPUAdagrad: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad),
                         fp32_optimizer_states)

    def _group_kwargs(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        return dict(lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"])


def _register() -> None:
    @torch.library.register_fake("hf_zero::adagrad_step")
    def _(param, grad, exp_avg_sq, out16, lr, eps, weight_decay, grad_scale):
        torch._check(param.dtype == torch.float32, lambda: "adagrad_step: param must be float32")
        torch._check(grad.numel() == param.numel(), lambda: "adagrad_step: grad and param differ in numel")
        return None


def _compiled() -> bool:
    """The kernel is in the loaded extension (an extension built before this op existed lacks it)."""
    return kernel_in_build("adagrad_step")


if _compiled():
    _register()
