"""``channel_pruning``: structured pruning of the hidden (residual-stream) channels of a decoder LM."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.schema import spec

from ..pruning_config import DenseRatioParams, PruningShared

__all__ = ["ChannelPruningShared", "ChannelPruningParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChannelPruningShared(PruningShared):
    enabled: bool = spec(False, help="turn channel pruning on")
    method: Literal["l1"] = spec("l1", help="l1: keep channels with the largest summed L1 norm over every "
                                            "weight that reads or writes them")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChannelPruningParams(DenseRatioParams):
    dense_ratio: float = spec(help="fraction of hidden channels kept")
