"""``sparse_pruning``: unstructured pruning, with an optional gradual (cubic) density schedule."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.errors import ConfigError
from hf_zero.config.schema import spec

from .._checks import check_ratio
from ..pruning_config import PruningShared

__all__ = ["SparsePruningShared", "SparsePruningParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparsePruningShared(PruningShared):
    enabled: bool = spec(False, help="turn unstructured pruning on")
    method: Literal["l1", "topk"] = spec("l1", help="l1: keep the largest |w|; topk: learn a score per weight "
                                                    "(straight-through) and keep the top scores")
    # restated: DeepSpeed's own keys for sparse_pruning (an hf_zero addition only for the structured methods)
    schedule_offset_end: int | None = spec(None, help="step at which the target density is reached (cubic "
                                                      "schedule); default: all at schedule_offset")
    schedule_offset_stride: int = spec(1, help="steps between mask updates during the gradual schedule")
    dense_ratio: float | None = spec(None, help="default dense_ratio for groups that do not set one")
    excluded_modules: tuple[str, ...] = spec((), help="module name patterns never pruned")

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.dense_ratio is not None:
            check_ratio(self.dense_ratio, f"{path}.dense_ratio")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparsePruningParams:
    """Unlike the structured methods' params, dense_ratio may be left to shared_parameters."""

    dense_ratio: float | None = spec(None, help="fraction of weights kept")

    def validate(self, path: str, shared: SparsePruningShared) -> None:
        ratio = self.dense_ratio if self.dense_ratio is not None else shared.dense_ratio
        if ratio is None:
            raise ConfigError(f"{path}.dense_ratio", "required (here or in shared_parameters)")
        check_ratio(ratio, f"{path}.dense_ratio")

    def ratio(self, shared: SparsePruningShared) -> float:
        return self.dense_ratio if self.dense_ratio is not None else shared.dense_ratio  # type: ignore[return-value]
