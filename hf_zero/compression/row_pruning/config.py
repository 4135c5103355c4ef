"""``row_pruning``: structured pruning of output rows (neurons) of linear layers, e.g. an MLP's up projection."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.schema import spec

from ..pruning_config import DenseRatioParams, PruningShared

__all__ = ["RowPruningShared", "RowPruningParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowPruningShared(PruningShared):
    enabled: bool = spec(False, help="turn row pruning on")
    method: Literal["l1", "topk"] = spec("l1", help="l1: keep rows with the largest L1 norm; topk: learned "
                                                    "row scores (straight-through)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowPruningParams(DenseRatioParams):
    dense_ratio: float = spec(help="fraction of rows kept")
