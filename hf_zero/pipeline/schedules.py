"""Choosing and building a ``torch.distributed.pipelining`` schedule; the stage class hf_zero hands to it.

The schedules are torch's; hf_zero adds the checks that turn torch's constraints into errors naming the config keys
a user controls, and a stage whose backward tells the ZeRO engine when a micro-batch's backward is done.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleLoopedBFS)

from hf_zero.config.errors import ConfigError

__all__ = ["SCHEDULES", "MULTI_STAGE", "check_schedule", "build_schedule", "EngineStage"]

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = {"interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble"}


def check_schedule(name: str, *, num_microbatches: int, num_stages: int, virtual_stages: int) -> None:
    """Refuse, naming the keys, what the schedule cannot run (before any rank starts communicating)."""
    if name not in SCHEDULES:
        raise ConfigError("pipeline.schedule", f"unknown schedule {name!r}; use one of {sorted(SCHEDULES)}")
    if name in MULTI_STAGE:
        if virtual_stages < 1:
            raise ConfigError("pipeline.virtual_stages", "must be >= 1")
    elif virtual_stages != 1:
        raise ConfigError("pipeline.virtual_stages", f"schedule {name!r} runs one stage per rank; virtual_stages "
                                                     f"is {virtual_stages}: use 'interleaved_1f1b' or set it to 1")
    m, p = num_microbatches, num_stages
    if name == "1f1b" and m < p:
        raise ConfigError("gradient_accumulation_steps",
                          f"schedule '1f1b' needs at least as many micro-batches as stages: {m} micro-batches "
                          f"(gradient_accumulation_steps) < {p} stages; raise gradient_accumulation_steps to >= {p} "
                          f"or use pipeline.schedule 'gpipe'")
    if name in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, m // p)
        if m % rounds != 0:
            raise ConfigError("gradient_accumulation_steps",
                              f"schedule {name!r} needs the micro-batches (gradient_accumulation_steps = {m}) to be "
                              f"a multiple of the rounds max(1, {m} // {p} stages) = {rounds}; use a multiple of {p}")


def build_schedule(name: str, stages: list[PipelineStage], num_microbatches: int, loss_fn: Callable | None):
    """The schedule object; losses are pre-scaled by the caller, so gradients are not divided again."""
    cls = SCHEDULES[name]
    if name in MULTI_STAGE:
        return cls(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)


class EngineStage(PipelineStage):
    """A ``PipelineStage`` that calls ``after_backward()`` when each micro-batch's backward is done (the ZeRO-3
    engine reduces that micro-batch's gradients into their shards and frees gathered parameters there)."""

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device, *,
                 group, after_backward: Callable[[], None] | None = None):
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self._after_backward = after_backward

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if self._after_backward is not None and backward_type in ("full", "weight"):
            self._after_backward()
        return result
