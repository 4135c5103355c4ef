"""Fused Adam/AdamW: the functional step the engine calls on flat partitions, and two optimizers.

* ``adam_step_(param, grad, exp_avg, exp_avg_sq, *, step, lr, ...)`` -- one in-place step over a flat fp32
  partition in one pass over memory; ``grad`` may be fp32, bf16 or fp16; ``grad_scale`` divides the gradient
  (loss-scale unscale and clipping coefficient folded in); ``out16`` receives the updated parameter in 16 bit.
  ``param`` may also be bf16/fp16 itself (no fp32 master): it is updated in fp32 and rounded once.
* ``AdamHyper`` -- the step's hyper-parameters of one group as one frozen value (``adam_step_(..., **h.kwargs())``).
* ``CPUAdam`` -- drop-in for DeepSpeed's ``DeepSpeedCPUAdam`` (same constructor), for offloaded optimizer states.
* ``FusedAdam`` -- the same for CUDA parameters, one multi-tensor launch per step; on CPU it runs the CPU kernel.
* ``zeros_state(shape, dtype, device)`` -- a zero-filled optimizer state; on CPU on transparent huge pages, which
  the memory-bound CPU step streams faster (csrc/adam/state_alloc.cpp). CPUAdam allocates its states with it.

Dispatch: compiled CPU kernel for CPU tensors, compiled CUDA kernel for CUDA tensors, ``adam_step_reference``
(pure PyTorch, torch.optim.Adam/AdamW semantics) when the extension for that device is not available.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.ops._native import native_available, warn_fallback
from hf_zero.ops._optim_common import FLOAT16, StateStepOptimizer

__all__ = ["AdamHyper", "CPUAdam", "FusedAdam", "adam_step_", "adam_step_any_dtype_", "adam_step_reference",
           "zeros_state"]


def zeros_state(shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled optimizer state tensor (contiguous).

    On CPU with the compiled extension loaded it lives on 2 MiB-aligned memory advised for transparent huge pages
    (``torch.ops.hf_zero.zeros_hugepage``; tensors under 2 MiB, and systems without THP, get ordinary pages): the
    CPU Adam step reads and writes every state element once per step, and on 4 KiB pages it pays a TLB miss per page
    and array (fp32 step 2-8% faster at 1 thread, benchmarks/RESULTS.md). Elsewhere ``torch.zeros``.
    """
    device = torch.device(device)
    # hasattr: an extension built before the op existed (a stale build) still loads; it gets torch.zeros.
    if device.type == "cpu" and native_available(device) and hasattr(torch.ops.hf_zero, "zeros_hugepage"):
        return torch.ops.hf_zero.zeros_hugepage(list(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _states_to_zeros_state(optimizer: CPUAdam) -> None:
    """load_state_dict post-hook: torch.optim rebuilds loaded states as ordinary tensors; copy the contiguous CPU
    ones into :func:`zeros_state` memory so a resumed run steps as fast as a fresh one."""
    for state in optimizer.state.values():
        for key in optimizer.STATE_KEYS:
            t = state.get(key)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous():
                fresh = zeros_state(t.shape, t.dtype, t.device)
                fresh.copy_(t)
                state[key] = fresh


@dataclass(frozen=True)
class AdamHyper:
    """One group's Adam hyper-parameters for one step, built once (:meth:`of_group`) and passed as one value."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool

    @classmethod
    def of_group(cls, group: Mapping[str, Any], step: int) -> "AdamHyper":
        """From an optimizer param group (``betas`` a pair; ``adamw_mode``/``bias_correction`` default true)."""
        beta1, beta2 = group["betas"]
        return cls(step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                   weight_decay=group["weight_decay"], adamw_mode=group.get("adamw_mode", True),
                   bias_correction=group.get("bias_correction", True))

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`adam_step_`."""
        return dataclasses.asdict(self)


def adam_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                        adamw_mode: bool, bias_correction: bool, grad_scale: float = 1.0,
                        out16: torch.Tensor | None = None) -> None:
    """Pure-PyTorch reference of ``adam_step_``: the formula of torch.optim.AdamW (adamw_mode) / Adam (L2)."""
    # A 16-bit param is computed in an fp32 copy and rounded once at the end, as the kernel does.
    p32 = param if param.dtype == torch.float32 else param.float()
    g = grad.reshape(p32.shape).float()
    if grad_scale != 1.0:
        g = g / grad_scale
    if weight_decay != 0.0:
        if adamw_mode:
            p32.mul_(1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p32
    exp_avg.lerp_(g.reshape(exp_avg.shape), 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g.reshape(exp_avg_sq.shape), g.reshape(exp_avg_sq.shape), value=1.0 - beta2)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    p32.addcdiv_(exp_avg.reshape(p32.shape), denom.reshape(p32.shape), value=-lr / bc1)
    if out16 is not None:
        out16.copy_(p32.reshape(out16.shape))
    if p32 is not param:
        param.copy_(p32)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
               bias_correction: bool, grad_scale: float = 1.0, out16: torch.Tensor | None = None) -> None:
    """One Adam/AdamW step, in place on ``param``, ``exp_avg`` and ``exp_avg_sq`` (fp32).

    ``param`` is the fp32 master, or on CPU a bf16/fp16 parameter (updated in fp32, rounded once on store).
    ``grad_used = grad / grad_scale``; ``out16`` (bf16/fp16, same numel) gets an fp32 param's update in 16 bit.
    """
    if native_available(param.device):
        # The kernel works on flat contiguous storage; strided views (rare: the engine passes flat partitions)
        # take the reference path, which handles any layout. 16-bit params in place: the CPU kernel only.
        flat = all(t is None or t.is_contiguous() for t in (param, exp_avg, exp_avg_sq, out16))
        param_ok = param.dtype == torch.float32 or (param.device.type == "cpu" and param.dtype in FLOAT16
                                                    and out16 is None)
        if flat and param_ok:
            torch.ops.hf_zero.adam_step(
                param, grad, exp_avg, exp_avg_sq, out16, int(step), float(lr), float(beta1), float(beta2),
                float(eps), float(weight_decay), bool(adamw_mode), bool(bias_correction), float(grad_scale),
            )
            return
    elif param.device.type in ("cpu", "cuda"):
        warn_fallback("adam_step", param.device)
    adam_step_reference(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction,
        grad_scale=grad_scale, out16=out16,
    )


_SLICE = 1 << 20  # elements per fp32 working slice of the low-precision Adam step


def adam_step_any_dtype_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         *, update=adam_step_, out16: torch.Tensor | None = None, **kwargs) -> None:
    """One Adam step of a shard whatever its storage dtypes, with ``update`` (:func:`adam_step_` or
    :func:`adam_step_reference`). fp32 master and moments: one fused pass, writing ``out16`` on the way. bf16 master
    weights and/or bf16 moments (bf16.bf16_master_weights_and_grads / bf16_optimizer_states): the math in fp32 on
    slices of at most ``_SLICE`` elements, results rounded back into the storage dtypes (and ``out16``), so no full
    fp32 copy of the shard ever exists. The on-device step and the optimizer offload both call it, so they give the
    same numbers."""
    if master.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32:
        update(master, grad, exp_avg, exp_avg_sq, out16=out16, **kwargs)
        return
    for lo in range(0, master.numel(), _SLICE):
        hi = min(lo + _SLICE, master.numel())
        p32, m32, v32 = master[lo:hi].float(), exp_avg[lo:hi].float(), exp_avg_sq[lo:hi].float()
        update(p32, grad[lo:hi], m32, v32, **kwargs)
        for dst, src in ((master, p32), (exp_avg, m32), (exp_avg_sq, v32), (out16, p32)):
            if dst is not None and dst.dtype != torch.float32:
                dst[lo:hi].copy_(src)


class CPUAdam(StateStepOptimizer):
    """Adam/AdamW over CPU parameters with the compiled kernel; constructor of DeepSpeed's DeepSpeedCPUAdam.

    Parameters are updated in fp32: fp32 parameters in place, 16-bit parameters through an fp32 copy written
    back in 16 bit by the kernel. Optimizer states are fp32 (``fp32_optimizer_states=True``) or in the
    parameter's dtype. Gradients may be fp32, bf16 or fp16.
    """

    # Read by hf_zero.runtime.optimizers: a client optimizer of this class is re-applied to the ZeRO shards as
    # the fused Adam update (adamw_mode and bias_correction come from its defaults).
    hf_zero_adam = True
    STATE_KEYS = ("exp_avg", "exp_avg_sq")
    _kernel = staticmethod(adam_step_)

    def __init__(self, model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            # DeepSpeedCPUAdam raises here too; silently ignoring it would change the optimizer.
            raise ValueError("CPUAdam does not support amsgrad=True (neither does DeepSpeedCPUAdam); use "
                             "torch.optim.AdamW(amsgrad=True) instead")
        if not 0.0 <= lr:
            raise ValueError(f"CPUAdam: invalid lr {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam: invalid betas {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        amsgrad=amsgrad, adamw_mode=adamw_mode)
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.register_load_state_dict_post_hook(_states_to_zeros_state)

    def _new_state(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return zeros_state(p.shape, dtype, p.device)  # huge pages: the memory-bound CPU step streams them faster

    def _group_kwargs(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        return AdamHyper.of_group(group, step).kwargs()

    def _in_place(self, p: torch.Tensor, states: list[torch.Tensor]) -> bool:
        # fp32 params, or 16-bit CPU params updated in place in one pass (DeepSpeedCPUAdam's layout)
        fp32_states = all(s.dtype == torch.float32 for s in states)
        return fp32_states and (p.dtype == torch.float32 or (p.device.type == "cpu" and p.dtype in FLOAT16))


class FusedAdam(CPUAdam):
    """Adam/AdamW for CUDA parameters: fp32 parameters of a group that share a step count are updated with one
    multi-tensor kernel launch; anything else (16-bit params, CPU params) goes through ``adam_step_``.

    DeepSpeed's FusedAdam constructor: ``adam_w_mode`` (True: AdamW's decoupled decay; False: Adam with the decay
    added to the gradient, L2) and ``set_grad_none`` (``zero_grad`` drops gradients rather than zeroing them).
    ``adamw_mode`` (CPUAdam's spelling) is accepted too; giving both with different values is an error.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, *, adamw_mode: bool | None = None,
                 fp32_optimizer_states: bool = True) -> None:
        if adamw_mode is not None and bool(adamw_mode) != bool(adam_w_mode):
            raise ValueError(f"FusedAdam: adam_w_mode={adam_w_mode!r} and adamw_mode={adamw_mode!r} disagree; "
                             "give one of them")
        mode = bool(adam_w_mode if adamw_mode is None else adamw_mode)
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=mode,
                         fp32_optimizer_states=fp32_optimizer_states)
        self.adam_w_mode = int(mode)  # DeepSpeed's attribute (1/0)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            # (device, step) -> lists for one multi-tensor launch
            batches: dict[tuple[torch.device, int], tuple[list, list, list, list]] = {}
            for p, state in self._due(group):
                fusable = (p.is_cuda and native_available(p.device) and p.dtype == torch.float32
                           and state["exp_avg"].dtype == torch.float32 and p.is_contiguous())
                if not fusable:
                    self._step_param(p, state, self._group_kwargs(group, state["step"]))
                    continue
                lists = batches.setdefault((p.device, state["step"]), ([], [], [], []))
                for lst, t in zip(lists, (p.data, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                    lst.append(t)
            for (_, step), (params, grads, exp_avgs, exp_avg_sqs) in batches.items():
                kw = self._group_kwargs(group, step)
                torch.ops.hf_zero.multi_tensor_adam(
                    params, grads, exp_avgs, exp_avg_sqs, kw["step"], float(kw["lr"]), float(kw["beta1"]),
                    float(kw["beta2"]), float(kw["eps"]), float(kw["weight_decay"]), bool(kw["adamw_mode"]),
                    bool(kw["bias_correction"]), 1.0,
                )
        return loss


def _register() -> None:
    @torch.library.register_fake("hf_zero::adam_step")
    def _(param, grad, exp_avg, exp_avg_sq, out16, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
          bias_correction, grad_scale):
        torch._check(param.dtype in (torch.float32, *FLOAT16), lambda: "adam_step: param must be a float type")
        torch._check(grad.numel() == param.numel(), lambda: "adam_step: grad and param differ in numel")
        return None

    @torch.library.register_fake("hf_zero::multi_tensor_adam")
    def _(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay, adamw_mode,
          bias_correction, grad_scale):
        torch._check(len(params) == len(grads), lambda: "multi_tensor_adam: list lengths differ")
        return None


if native_available("cpu"):
    _register()
