"""``channel_pruning``: structured pruning of the hidden (residual-stream) channels of a decoder LM."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.schema import spec

from .._checks import check_offsets, check_ratio

__all__ = ["ChannelPruningShared", "ChannelPruningParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChannelPruningShared:
    enabled: bool = spec(False, help="turn channel pruning on")
    method: Literal["l1"] = spec("l1", help="l1: keep channels with the largest summed L1 norm over every "
                                            "weight that reads or writes them")
    schedule_offset: int = spec(0, help="step at which pruning starts")
    schedule_offset_end: int | None = spec(None, help="hf_zero: step at which the target is reached (cubic)")
    schedule_offset_stride: int = spec(1, help="hf_zero: steps between mask updates while ramping")

    def validate(self, path: str) -> None:
        check_offsets(self.schedule_offset, self.schedule_offset_end, self.schedule_offset_stride, path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChannelPruningParams:
    dense_ratio: float = spec(help="fraction of hidden channels kept")

    def validate(self, path: str, shared: ChannelPruningShared) -> None:
        check_ratio(self.dense_ratio, f"{path}.dense_ratio")
