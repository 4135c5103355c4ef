"""``head_pruning``: structured pruning of attention heads, masked on the attention output projection."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.errors import ConfigError
from hf_zero.config.schema import spec

from ..pruning_config import DenseRatioParams, PruningShared

__all__ = ["HeadPruningShared", "HeadPruningParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadPruningShared(PruningShared):
    enabled: bool = spec(False, help="turn head pruning on")
    method: Literal["l1", "topk"] = spec("l1", help="l1: keep heads whose output-projection columns have the "
                                                    "largest L1 norm; topk: learned head scores")
    num_heads: int | None = spec(None, help="attention heads per layer; default: the model config's "
                                            "num_attention_heads")

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.num_heads is not None and self.num_heads < 1:
            raise ConfigError(f"{path}.num_heads", f"must be >= 1, got {self.num_heads}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadPruningParams(DenseRatioParams):
    dense_ratio: float = spec(help="fraction of heads kept")
