"""``head_pruning``: structured pruning of attention heads, masked on the attention output projection."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.errors import ConfigError
from hf_zero.config.schema import spec

from .._checks import check_offsets, check_ratio

__all__ = ["HeadPruningShared", "HeadPruningParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadPruningShared:
    enabled: bool = spec(False, help="turn head pruning on")
    method: Literal["l1", "topk"] = spec("l1", help="l1: keep heads whose output-projection columns have the "
                                                    "largest L1 norm; topk: learned head scores")
    num_heads: int | None = spec(None, help="attention heads per layer; default: the model config's "
                                            "num_attention_heads")
    schedule_offset: int = spec(0, help="step at which pruning starts")
    schedule_offset_end: int | None = spec(None, help="hf_zero: step at which the target is reached (cubic)")
    schedule_offset_stride: int = spec(1, help="hf_zero: steps between mask updates while ramping")

    def validate(self, path: str) -> None:
        check_offsets(self.schedule_offset, self.schedule_offset_end, self.schedule_offset_stride, path)
        if self.num_heads is not None and self.num_heads < 1:
            raise ConfigError(f"{path}.num_heads", f"must be >= 1, got {self.num_heads}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadPruningParams:
    dense_ratio: float = spec(help="fraction of heads kept")

    def validate(self, path: str, shared: HeadPruningShared) -> None:
        check_ratio(self.dense_ratio, f"{path}.dense_ratio")
