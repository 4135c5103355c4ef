"""``sparse_pruning``: unstructured pruning, with an optional gradual (cubic) density schedule."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.schema import spec

from .._checks import check_offsets, check_ratio

__all__ = ["SparsePruningShared", "SparsePruningParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparsePruningShared:
    enabled: bool = spec(False, help="turn unstructured pruning on")
    method: Literal["l1", "topk"] = spec("l1", help="l1: keep the largest |w|; topk: learn a score per weight "
                                                    "(straight-through) and keep the top scores")
    schedule_offset: int = spec(0, help="step at which pruning starts")
    schedule_offset_end: int | None = spec(None, help="step at which the target density is reached (cubic "
                                                      "schedule); default: all at schedule_offset")
    schedule_offset_stride: int = spec(1, help="steps between mask updates during the gradual schedule")
    dense_ratio: float | None = spec(None, help="default dense_ratio for groups that do not set one")
    excluded_modules: tuple[str, ...] = spec((), help="module name patterns never pruned")

    def validate(self, path: str) -> None:
        check_offsets(self.schedule_offset, self.schedule_offset_end, self.schedule_offset_stride, path)
        if self.dense_ratio is not None:
            check_ratio(self.dense_ratio, f"{path}.dense_ratio")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparsePruningParams:
    dense_ratio: float | None = spec(None, help="fraction of weights kept")

    def validate(self, path: str, shared: SparsePruningShared) -> None:
        ratio = self.dense_ratio if self.dense_ratio is not None else shared.dense_ratio
        if ratio is None:
            from hf_zero.config.errors import ConfigError

            raise ConfigError(f"{path}.dense_ratio", "required (here or in shared_parameters)")
        check_ratio(ratio, f"{path}.dense_ratio")

    def ratio(self, shared: SparsePruningShared) -> float:
        return self.dense_ratio if self.dense_ratio is not None else shared.dense_ratio  # type: ignore[return-value]
