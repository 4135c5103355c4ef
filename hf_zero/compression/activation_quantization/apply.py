"""Install activation quantizers on the inputs of the linear modules each group selects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..install import install_each
from .layer import ActivationQuantizer

if TYPE_CHECKING:
    from ..config import Group, MethodConfig

__all__ = ["install"]


def install(model: nn.Module, cfg: MethodConfig) -> list[str]:
    return install_each(model, cfg, _quantizer)


def _quantizer(model: nn.Module, cfg: MethodConfig, group: Group, name: str) -> ActivationQuantizer:
    shared = cfg.shared
    return ActivationQuantizer(bits=group.params.bits, offset=shared.schedule_offset,
                               symmetric=shared.quantization_type == "symmetric",
                               static=shared.range_calibration == "static",
                               momentum=shared.range_momentum).to(model.get_submodule(name).weight.device)
