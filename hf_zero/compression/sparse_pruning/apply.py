"""Install unstructured masks (one unit per weight element) on the modules each group selects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..install import install_each
from ..layer import full_shape
from ..masking import UnitMask

if TYPE_CHECKING:
    from ..config import Group, MethodConfig

__all__ = ["install"]


def install(model: nn.Module, cfg: MethodConfig) -> list[str]:
    return install_each(model, cfg, _mask, excluded=cfg.shared.excluded_modules)


def _mask(model: nn.Module, cfg: MethodConfig, group: Group, name: str) -> UnitMask:
    shared = cfg.shared
    weight = model.get_submodule(name).weight
    return UnitMask(weight=weight, axis="element", num_units=full_shape(weight).numel(), method=shared.method,
                    schedule=shared.density_schedule(group.params.ratio(shared)), mask_bias=False)
