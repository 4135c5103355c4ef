"""Install activation quantizers on the inputs of the linear modules each group selects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn


from ..layer import wrap_linear
from ..matching import blamed_on, match_group
from .layer import ActivationQuantizer

if TYPE_CHECKING:
    from ..config import MethodConfig

__all__ = ["install"]


def install(model: nn.Module, cfg: MethodConfig) -> list[str]:
    shared = cfg.shared
    touched: list[str] = []
    for group in cfg.groups:
        for name in match_group(model, group):
            module = wrap_linear(model, name)
            quantizer = ActivationQuantizer(bits=group.params.bits, offset=shared.schedule_offset,
                                            symmetric=shared.quantization_type == "symmetric",
                                            static=shared.range_calibration == "static",
                                            momentum=shared.range_momentum).to(module.weight.device)
            with blamed_on(group, name):
                module.add_input_transform("activation_quantization", quantizer)
            touched.append(name)
    return touched
