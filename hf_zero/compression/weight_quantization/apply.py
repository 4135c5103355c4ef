"""Install weight quantizers on the modules each group selects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hf_zero.config.errors import ConfigError

from ..install import install_each
from ..layer import full_shape
from ..quant import GroupSpec
from ..schedule import BitSchedule
from .layer import WeightQuantizer

if TYPE_CHECKING:
    from ..config import Group, MethodConfig

__all__ = ["install"]


def install(model: nn.Module, cfg: MethodConfig) -> list[str]:
    return install_each(model, cfg, _quantizer)


def _quantizer(model: nn.Module, cfg: MethodConfig, group: Group, name: str) -> WeightQuantizer:
    shared, p = cfg.shared, group.params
    groups = GroupSpec(quantize_groups=shared.quantize_groups, per_channel=shared.per_channel,
                       group_size=shared.group_size)
    weight = model.get_submodule(name).weight
    shape = full_shape(weight)
    problem = groups.check(shape)
    if problem:
        raise ConfigError(f"{cfg.path}.shared_parameters", f"{problem} of {name} {tuple(shape)}")
    mix_step = shared.fp16_mixed_quantize.quantize_change_ratio if shared.fp16_mixed_quantize.enabled else None
    return WeightQuantizer(schedule=BitSchedule(p.start_bits, p.target_bits, shared.schedule_offset,
                                                p.quantization_period),
                           symmetric=shared.quantization_type == "symmetric", groups=groups,
                           stochastic=shared.rounding == "stochastic", mix_step=mix_step,
                           verbose=shared.quantize_verbose).to(weight.device)
