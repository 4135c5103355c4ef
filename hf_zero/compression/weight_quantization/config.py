"""``weight_quantization``: shared_parameters and per-group params (DeepSpeed names, plus ``group_size``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from hf_zero.config.errors import ConfigError
from hf_zero.config.schema import spec

from .._checks import check_offset

__all__ = ["WeightQuantizationShared", "WeightQuantizationParams", "MixedQuantize"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedQuantize:
    enabled: bool = spec(False, help="blend fp and quantized weights, moving to fully quantized over time")
    quantize_change_ratio: float = spec(0.001, help="share of the quantized weight added per step")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightQuantizationShared:
    enabled: bool = spec(False, help="turn weight quantization-aware training on")
    schedule_offset: int = spec(0, help="training step at which fake quantization starts")
    quantization_type: Literal["symmetric", "asymmetric"] = spec("symmetric", help="zero point or not")
    quantize_groups: int = spec(1, help="scales per weight: the flattened weight is split into this many "
                                        "contiguous groups (1: per tensor; out_features: per output channel)")
    per_channel: bool = spec(False, help="hf_zero: one scale per output channel (overrides quantize_groups)")
    group_size: int | None = spec(None, help="hf_zero: one scale per this many consecutive input features of "
                                             "each output channel (overrides quantize_groups and per_channel)")
    rounding: Literal["nearest", "stochastic"] = spec("nearest", help="rounding of w/scale during training")
    quantize_weight_in_forward: bool = spec(True, help="accepted for DeepSpeed configs; hf_zero always "
                                                       "quantizes in the forward pass")
    quantizer_kernel: bool = spec(False, help="accepted for DeepSpeed configs; hf_zero's quantizer is pure "
                                              "PyTorch on every device")
    quantize_verbose: bool = spec(False, help="log bit changes")
    fp16_mixed_quantize: MixedQuantize = spec(default_factory=MixedQuantize, help="gradual blending")

    def validate(self, path: str) -> None:
        check_offset(self.schedule_offset, path)
        if self.quantize_groups < 1:
            raise ConfigError(f"{path}.quantize_groups", f"must be >= 1, got {self.quantize_groups}")
        if self.group_size is not None and self.group_size < 1:
            raise ConfigError(f"{path}.group_size", f"must be >= 1, got {self.group_size}")
        r = self.fp16_mixed_quantize.quantize_change_ratio
        if not 0.0 < r <= 1.0:
            raise ConfigError(f"{path}.fp16_mixed_quantize.quantize_change_ratio", f"must be in (0, 1], got {r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightQuantizationParams:
    start_bits: int = spec(8, help="bits when quantization starts")
    target_bits: int = spec(8, help="bits reached at the end of the schedule")
    quantization_period: int = spec(0, help="steps between one-bit reductions from start_bits to target_bits")

    def validate(self, path: str, shared: WeightQuantizationShared) -> None:
        for key in ("start_bits", "target_bits"):
            bits = getattr(self, key)
            if not 2 <= bits <= 16:
                raise ConfigError(f"{path}.{key}", f"must be between 2 and 16 bits, got {bits}")
        if self.target_bits > self.start_bits:
            raise ConfigError(f"{path}.target_bits", f"({self.target_bits}) must not exceed start_bits "
                                                     f"({self.start_bits}): the schedule only removes bits")
        if self.quantization_period < 0:
            raise ConfigError(f"{path}.quantization_period", f"must be >= 0, got {self.quantization_period}")
        if self.start_bits != self.target_bits and self.quantization_period == 0:
            raise ConfigError(f"{path}.quantization_period", "must be > 0 when start_bits != target_bits")
