"""The optimizer back-end: where master weights and optimizer states live, and the one ``step`` that updates them.

:class:`~hf_zero.zero.optimizer.ZeroOptimizer` does what every placement shares -- the global gradient norm, the
overflow decision, the combined divisor (loss scale / clip coefficient), the Adam hyper-parameters (one frozen
:class:`~hf_zero.ops.adam.AdamHyper` per group per step) -- and hands them to exactly one back-end, chosen once
when the engine is built::

    back-end                         masters and states                       step
    FusedAdamBackend   (resident)    ``g.master``; moments in optimizer.state  the fused Adam kernel, writing the
                                     [g.master], on the group's device          16-bit shard in the same pass
    TorchOptimizerBackend (resident) ``g.master``; the wrapped torch           the torch optimizer's own step on
                                     optimizer's state                          ``g.master.grad``
    OptimizerOffload (CPU, NVMe)     hf_zero.offload: a resident tier, then    tile by tile, compiled CPU Adam
                                     CPU memory or swap files

Every back-end has ``step(states, hyper, divisor)``: ``states[i]`` is ``optimizer.state[g.master]`` of group i
(Adam's step count, and the resident moments), ``hyper[i]`` its AdamHyper (None for the torch back-end, which
reads its param_groups itself). With an offload, ``g.master`` holds no bytes: it is a meta tensor of the master's
shape and dtype (:meth:`~hf_zero.zero.sharded_group.ShardedGroup.release_master`), still what the optimizer's
``param_groups`` and ``state`` are keyed by, and the values are read through the back-end.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from hf_zero.offload.swapper import wait_all
from hf_zero.ops.adam import AdamHyper, adam_step_any_dtype_, zeros_state
from hf_zero.profiling.timers import NO_TIMERS

__all__ = ["OptimizerBackend", "FusedAdamBackend", "TorchOptimizerBackend"]


class OptimizerBackend(Protocol):
    uses_adam_hyper: bool  # step takes one AdamHyper per group
    offloaded: bool        # masters and states live outside the groups (offload_optimizer)
    timers: object         # the engine's timers (time blocked on offload I/O)

    def step(self, states: Sequence[dict] | None, hyper: Sequence[AdamHyper] | None, divisor: float) -> None:
        """One update of every group's master shard from its gradient shard divided by ``divisor``; the 16-bit
        shard is written too."""

    def close(self) -> None:
        """Release what the back-end holds outside memory (swap files)."""


class FusedAdamBackend:
    """Adam / AdamW, states resident next to the master, one fused pass per group."""

    uses_adam_hyper = True
    offloaded = False

    def __init__(self, groups: Sequence, state_dtype: torch.dtype = torch.float32) -> None:
        self.groups = list(groups)
        self.state_dtype = state_dtype  # Adam moments: fp32, or bf16 with bf16.bf16_optimizer_states
        self.timers = NO_TIMERS

    def step(self, states, hyper, divisor: float) -> None:
        for g, state, h in zip(self.groups, states, hyper):
            if "exp_avg" not in state:
                # on huge pages where the states are host memory (zeros_state): the step streams every element
                state["exp_avg"] = zeros_state(g.master.shape, self.state_dtype, g.master.device)
                state["exp_avg_sq"] = zeros_state(g.master.shape, self.state_dtype, g.master.device)
            # The 16-bit weights are written in the same pass: into param16, or (swapped ZeRO-3 shards,
            # param16 None) into a scratch buffer that write_param16 then sends to the swap files.
            out16 = g.param16
            if out16 is None and g.compute_dtype != torch.float32:
                out16 = torch.empty(g.shard_numel, dtype=g.compute_dtype, device=g.master.device)
            adam_step_any_dtype_(g.master, g.grad, state["exp_avg"], state["exp_avg_sq"], **h.kwargs(),
                                 grad_scale=divisor, out16=None if out16 is None or out16 is g.master else out16)
            if g.param16 is None:
                wait_all(g.write_param16(0, g.shard_numel, g.master if out16 is None else out16))

    def close(self) -> None:
        pass


class TorchOptimizerBackend:
    """Any other torch optimizer, stepping the master shards (its param_groups' tensors) with their gradients."""

    uses_adam_hyper = False
    offloaded = False

    def __init__(self, groups: Sequence, inner: torch.optim.Optimizer) -> None:
        self.groups = list(groups)
        self.inner = inner
        self.timers = NO_TIMERS

    def step(self, states, hyper, divisor: float) -> None:
        for g in self.groups:
            grad = g.grad if g.grad.dtype == g.master.dtype else g.grad.to(g.master.dtype)
            if divisor != 1.0:
                grad.div_(divisor)
            g.master.grad = grad
        self.inner.step()
        for g in self.groups:
            wait_all(g.write_param16(0, g.shard_numel, g.master))

    def close(self) -> None:
        pass
