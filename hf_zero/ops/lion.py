"""Lion over CPU tensors: the compiled ``hf_zero::lion_step`` kernel, its pure-PyTorch reference, and
``CPULion`` (DeepSpeed's ``DeepSpeedCPULion``: same constructor, same update, same state key).

The update (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023)::

    g = grad / grad_scale
    p = p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g

Dispatch: the compiled CPU kernel for contiguous fp32 CPU tensors, ``lion_step_reference`` otherwise (with
the one-time fallback warning of :mod:`hf_zero.ops._native` when the kernel is missing).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hf_zero.ops._optim_common import StateStepOptimizer, cpu_kernel_ready, kernel_in_build

__all__ = ["CPULion", "lion_step_", "lion_step_reference"]


def lion_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
                        beta1: float, beta2: float, weight_decay: float, grad_scale: float = 1.0,
                        out16: torch.Tensor | None = None) -> None:
    """Pure-PyTorch reference of :func:`lion_step_`."""
    g = grad.reshape(exp_avg.shape).float()
    if grad_scale != 1.0:
        g = g / grad_scale
    update = (exp_avg * beta1 + g * (1.0 - beta1)).sign_()
    param.mul_(1.0 - lr * weight_decay).sub_(update.reshape(param.shape) * lr)
    exp_avg.mul_(beta2).add_(g * (1.0 - beta2))
    if out16 is not None:
        out16.copy_(param.reshape(out16.shape))


def lion_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float, beta1: float,
               beta2: float, weight_decay: float, grad_scale: float = 1.0, out16: torch.Tensor | None = None) -> None:
    """One Lion step in place on ``param`` and ``exp_avg`` (fp32); ``grad`` fp32/bf16/fp16; ``out16`` gets the
    updated parameter in 16 bit."""
    if cpu_kernel_ready("lion_step", param, (exp_avg,), out16):
        torch.ops.hf_zero.lion_step(param, grad, exp_avg, out16, float(lr), float(beta1), float(beta2),
                                    float(weight_decay), float(grad_scale))
        return
    lion_step_reference(param, grad, exp_avg, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                        grad_scale=grad_scale, out16=out16)


class CPULion(StateStepOptimizer):
    """Lion over CPU parameters with the compiled kernel; constructor of DeepSpeed's DeepSpeedCPULion.

    fp32 parameters are updated in place; 16-bit parameters through an fp32 copy written back in 16 bit. The
    momentum ``exp_avg`` is fp32 (``fp32_optimizer_states=True``) or the parameter's dtype.
    """

    hf_zero_elementwise = True  # see CPUAdagrad: same result on a ZeRO shard as on the full tensor
    STATE_KEYS = ("exp_avg",)  # the momentum, DeepSpeedCPULion's name
    _kernel = staticmethod(lion_step_)

    def __init__(self, model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 fp32_optimizer_states: bool = True) -> None:
        if lr < 0.0:
            raise ValueError(f"CPULion: invalid lr {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPULion: invalid betas {betas}")
        super().__init__(model_params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay),
                         fp32_optimizer_states)

    def _group_kwargs(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])


def _register() -> None:
    @torch.library.register_fake("hf_zero::lion_step")
    def _(param, grad, exp_avg, out16, lr, beta1, beta2, weight_decay, grad_scale):
        torch._check(param.dtype == torch.float32, lambda: "lion_step: param must be float32")
        torch._check(grad.numel() == param.numel(), lambda: "lion_step: grad and param differ in numel")
        return None


def _compiled() -> bool:
    """The kernel is in the loaded extension (an extension built before this op existed lacks it)."""
    return kernel_in_build("lion_step")


if _compiled():
    _register()
