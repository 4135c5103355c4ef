"""``row_pruning``: structured pruning of output rows (neurons) of linear layers, e.g. an MLP's up projection."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.schema import spec

from .._checks import check_offsets, check_ratio

__all__ = ["RowPruningShared", "RowPruningParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowPruningShared:
    enabled: bool = spec(False, help="turn row pruning on")
    method: Literal["l1", "topk"] = spec("l1", help="l1: keep rows with the largest L1 norm; topk: learned "
                                                    "row scores (straight-through)")
    schedule_offset: int = spec(0, help="step at which pruning starts")
    schedule_offset_end: int | None = spec(None, help="hf_zero: step at which the target is reached (cubic)")
    schedule_offset_stride: int = spec(1, help="hf_zero: steps between mask updates while ramping")

    def validate(self, path: str) -> None:
        check_offsets(self.schedule_offset, self.schedule_offset_end, self.schedule_offset_stride, path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowPruningParams:
    dense_ratio: float = spec(help="fraction of rows kept")

    def validate(self, path: str, shared: RowPruningShared) -> None:
        check_ratio(self.dense_ratio, f"{path}.dense_ratio")
