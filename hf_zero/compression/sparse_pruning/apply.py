"""Install unstructured masks (one unit per weight element) on the modules each group selects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn


from ..layer import full_shape, wrap_linear
from ..masking import UnitMask
from ..matching import blamed_on, match_group
from ..schedule import DensitySchedule

if TYPE_CHECKING:
    from ..config import MethodConfig

__all__ = ["install"]


def install(model: nn.Module, cfg: MethodConfig) -> list[str]:
    shared = cfg.shared
    touched: list[str] = []
    for group in cfg.groups:
        schedule = DensitySchedule(group.params.ratio(shared), shared.schedule_offset, shared.schedule_offset_end,
                                   shared.schedule_offset_stride)
        for name in match_group(model, group, excluded=shared.excluded_modules):
            module = wrap_linear(model, name)
            mask = UnitMask(weight=module.weight, axis="element", num_units=full_shape(module.weight).numel(),
                            method=shared.method, schedule=schedule, mask_bias=False)
            with blamed_on(group, name):
                module.add_weight_transform("sparse_pruning", mask)
            touched.append(name)
    return touched
