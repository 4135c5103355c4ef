"""Install weight quantizers on the modules each group selects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hf_zero.config.errors import ConfigError

from ..layer import full_shape, wrap_linear
from ..matching import blamed_on, match_group
from ..quant import GroupSpec
from ..schedule import BitSchedule
from .layer import WeightQuantizer

if TYPE_CHECKING:
    from ..config import MethodConfig

__all__ = ["install"]


def install(model: nn.Module, cfg: MethodConfig) -> list[str]:
    shared = cfg.shared
    groups = GroupSpec(quantize_groups=shared.quantize_groups, per_channel=shared.per_channel,
                       group_size=shared.group_size)
    mix_step = shared.fp16_mixed_quantize.quantize_change_ratio if shared.fp16_mixed_quantize.enabled else None
    touched: list[str] = []
    for group in cfg.groups:
        p = group.params
        schedule = BitSchedule(p.start_bits, p.target_bits, shared.schedule_offset, p.quantization_period)
        for name in match_group(model, group):
            weight = model.get_submodule(name).weight
            shape = full_shape(weight)
            problem = groups.check(shape)
            if problem:
                raise ConfigError(f"{cfg.path}.shared_parameters", f"{problem} of {name} {tuple(shape)}")
            quantizer = WeightQuantizer(schedule=schedule, symmetric=shared.quantization_type == "symmetric",
                                        groups=groups, stochastic=shared.rounding == "stochastic",
                                        mix_step=mix_step, verbose=shared.quantize_verbose).to(weight.device)
            module = wrap_linear(model, name)
            with blamed_on(group, name):
                module.add_weight_transform("weight_quantization", quantizer)
            touched.append(name)
    return touched

