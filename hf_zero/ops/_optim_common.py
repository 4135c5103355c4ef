"""What CPUAdam, CPUAdagrad and CPULion share, so each of adam.py, adagrad.py and lion.py keeps only its algorithm
(hyper-parameters, kernel call, pure-PyTorch reference).

* ``StateStepOptimizer`` -- the ``torch.optim.Optimizer`` plumbing: the closure, the walk over param groups, state
  creation, step counting, and running a 16-bit parameter (or 16-bit states) through fp32 copies.
* ``cpu_kernel_ready(op, param, states, out16)`` -- whether a CPU-only kernel (adagrad_step, lion_step) can take
  these tensors, warning once when the reference must run instead because the kernel is missing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hf_zero.ops._native import native_available, stale_build_warning, warn_fallback

__all__ = ["FLOAT16", "StateStepOptimizer", "cpu_kernel_ready", "kernel_in_build"]

FLOAT16 = (torch.bfloat16, torch.float16)


@functools.cache
def kernel_in_build(op: str) -> bool:
    """``hf_zero::op`` is in the loaded CPU extension (an extension built before the op existed lacks it)."""
    return native_available("cpu") and hasattr(torch.ops.hf_zero, op)


def cpu_kernel_ready(op: str, param: torch.Tensor, states: tuple[torch.Tensor, ...],
                     out16: torch.Tensor | None) -> bool:
    """True when the compiled CPU kernel ``op`` takes these tensors: fp32 ``param`` and ``states``, all contiguous
    (the kernel walks flat storage). Otherwise the caller runs the reference, which takes any layout and dtype;
    for a CPU tensor whose kernel is missing, say once why (a stale build, or no extension at all)."""
    if param.device.type != "cpu":
        return False
    if not kernel_in_build(op):
        if native_available("cpu"):
            stale_build_warning(op)
        else:
            warn_fallback(op, param.device)
        return False
    return (param.dtype == torch.float32 and all(s.dtype == torch.float32 for s in states)
            and all(t is None or t.is_contiguous() for t in (param, *states, out16)))


class StateStepOptimizer(torch.optim.Optimizer):
    """An optimizer whose per-parameter state is ``step`` plus the tensors named in ``STATE_KEYS``, updated in
    place by one functional step (``adam_step_``, ``adagrad_step_``, ``lion_step_``) that works in fp32.

    A subclass supplies ``STATE_KEYS``, :meth:`_group_kwargs` (its hyper-parameters) and :meth:`_kernel` (its
    functional step); it may widen :meth:`_in_place` where its kernel takes more than fp32 tensors.
    """

    STATE_KEYS: tuple[str, ...] = ()

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any],
                 fp32_optimizer_states: bool) -> None:
        super().__init__(params, defaults)
        # DeepSpeed's switch: states in fp32 (the default) or in each parameter's own dtype
        self.fp32_optimizer_states = fp32_optimizer_states

    def _new_state(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(p.shape, dtype=dtype, device=p.device)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state_dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
            state["step"] = 0
            for key in self.STATE_KEYS:
                state[key] = self._new_state(p, state_dtype)
        return state

    def _group_kwargs(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        """The hyper-parameter keywords of :meth:`_kernel` for ``group`` at ``step``."""
        raise NotImplementedError

    def _kernel(self, param: torch.Tensor, grad: torch.Tensor, *states: torch.Tensor,
                out16: torch.Tensor | None = None, **kwargs: Any) -> None:
        """The functional step: in place on fp32 ``param`` and ``states`` (in ``STATE_KEYS`` order)."""
        raise NotImplementedError

    def _in_place(self, p: torch.Tensor, states: list[torch.Tensor]) -> bool:
        """The kernel can update ``p`` and its states where they lie, without fp32 copies."""
        return p.dtype == torch.float32 and all(s.dtype == torch.float32 for s in states)

    def _step_param(self, p: torch.Tensor, state: dict[str, Any], kwargs: dict[str, Any]) -> None:
        states = [state[key] for key in self.STATE_KEYS]
        if self._in_place(p, states):
            self._kernel(p.data, p.grad, *states, **kwargs)
            return
        # 16-bit parameter (and maybe 16-bit states): compute in fp32, write back in the storage dtypes.
        master = p.data.float()
        states32 = [s.float() for s in states]
        self._kernel(master, p.grad, *states32, out16=p.data if p.dtype in FLOAT16 else None, **kwargs)
        if p.dtype not in FLOAT16:
            p.data.copy_(master)
        for s, s32 in zip(states, states32):
            if s32.data_ptr() != s.data_ptr():  # .float() of an fp32 state is the state itself: nothing to copy
                s.copy_(s32)

    @staticmethod
    def _closure_loss(closure) -> Any:
        """torch.optim's contract: ``step`` re-evaluates the model through ``closure`` (with grad) when given."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _due(self, group: dict[str, Any]) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """``(param, state)`` for each parameter of ``group`` with a gradient, its state created and ``step``
        already advanced for this step."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self._init_state(p)
            state["step"] += 1
            yield p, state

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            for p, state in self._due(group):
                self._step_param(p, state, self._group_kwargs(group, state["step"]))
        return loss
