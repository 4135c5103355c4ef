"""``activation_quantization``: fake quantization of the inputs of selected linear layers."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.errors import ConfigError
from hf_zero.config.schema import spec

from .._checks import check_offset

__all__ = ["ActivationQuantizationShared", "ActivationQuantizationParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationQuantizationShared:
    enabled: bool = spec(False, help="turn activation fake quantization on")
    schedule_offset: int = spec(0, help="training step at which activation quantization starts")
    quantization_type: Literal["symmetric", "asymmetric"] = spec("asymmetric", help="zero point or not")
    range_calibration: Literal["dynamic", "static"] = spec(
        "dynamic", help="dynamic: range of each input tensor; static: running (EMA) range over training")
    range_momentum: float = spec(0.9, help="hf_zero: EMA momentum of the static range")

    def validate(self, path: str) -> None:
        check_offset(self.schedule_offset, path)
        if not 0.0 <= self.range_momentum < 1.0:
            raise ConfigError(f"{path}.range_momentum", f"must be in [0, 1), got {self.range_momentum}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationQuantizationParams:
    bits: int = spec(8, help="bits of the quantized input")

    def validate(self, path: str, shared: ActivationQuantizationShared) -> None:
        if not 2 <= self.bits <= 16:
            raise ConfigError(f"{path}.bits", f"must be between 2 and 16 bits, got {self.bits}")
