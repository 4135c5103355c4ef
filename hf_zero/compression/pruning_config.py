"""The config every pruning method shares: DeepSpeed's pruning ``shared_parameters`` (on/off, ranking method, the
start step and hf_zero's gradual ramp) and a structured group's ``params`` (the share of units kept).

A method's classes derive from these and restate a field only to say what is its own: its help text (which names
the method, and is what a "required key missing" error shows) or a narrower choice of values. A restated field
keeps its place, so every pruning method lists its keys in DeepSpeed's order (the model card writes them so).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from hf_zero.config.schema import spec

from ._checks import check_offsets, check_ratio
from .schedule import DensitySchedule

__all__ = ["PruningShared", "DenseRatioParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PruningShared:
    enabled: bool = spec(False, help="turn pruning on")
    method: Literal["l1", "topk"] = spec("l1", help="l1: keep the units with the largest L1 norm; topk: learned "
                                                    "unit scores (straight-through)")
    schedule_offset: int = spec(0, help="step at which pruning starts")
    schedule_offset_end: int | None = spec(None, help="hf_zero: step at which the target is reached (cubic)")
    schedule_offset_stride: int = spec(1, help="hf_zero: steps between mask updates while ramping")

    def validate(self, path: str) -> None:
        check_offsets(self.schedule_offset, self.schedule_offset_end, self.schedule_offset_stride, path)

    def density_schedule(self, target: float) -> DensitySchedule:
        """Density over training steps for a group whose dense_ratio is ``target``: one place maps the three
        schedule keys onto the schedule, so every pruning method starts and ramps alike."""
        return DensitySchedule(target, self.schedule_offset, self.schedule_offset_end, self.schedule_offset_stride)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseRatioParams:
    dense_ratio: float = spec(help="fraction of units kept")

    def validate(self, path: str, shared: Any) -> None:
        check_ratio(self.dense_ratio, f"{path}.dense_ratio")
