"""Fake quantization of a linear weight (quantization-aware training, straight-through estimator)."""

from __future__ import annotations

import logging

import torch

from ..layer import WeightTransform
from ..quant import GroupSpec, fake_quant, group_view
from ..schedule import BitSchedule

__all__ = ["WeightQuantizer"]

logger = logging.getLogger("hf_zero.compression")


class WeightQuantizer(WeightTransform):
    """State: ``bits`` (0 = not started yet) and ``mix`` (share of the quantized weight in the effective one;
    1 unless ``fp16_mixed_quantize`` ramps it)."""

    def __init__(self, *, schedule: BitSchedule, symmetric: bool, groups: GroupSpec, stochastic: bool,
                 mix_step: float | None, verbose: bool = False):
        super().__init__()
        self.schedule = schedule
        self.symmetric = symmetric
        self.groups = groups
        self.stochastic = stochastic
        self.mix_step = mix_step
        self.verbose = verbose
        self.register_buffer("bits", torch.tensor(0, dtype=torch.int32))
        self.register_buffer("mix", torch.tensor(1.0))

    def set_step(self, step: int) -> None:
        bits = self.schedule.at(step)
        if self.verbose and bits != int(self.bits):
            logger.info("weight quantization: %d -> %d bits at step %d", int(self.bits), bits, step)
        self.bits.fill_(bits)
        if self.mix_step is not None:
            self.mix.fill_(min(1.0, max(0.0, (step - self.schedule.offset + 1) * self.mix_step)))

    def forward(self, weight: torch.Tensor, bias: torch.Tensor | None):
        bits = int(self.bits)
        if bits == 0:
            return weight, bias
        stochastic = self.stochastic and self.training and torch.is_grad_enabled()
        q = fake_quant(group_view(weight, self.groups), bits, self.symmetric, stochastic).view_as(weight)
        mix = float(self.mix)
        if mix < 1.0:
            q = weight + mix * (q - weight)
        return q, bias

    def stats(self) -> dict[str, float]:
        return {"bits": float(self.bits)}

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"bits={int(self.bits)}, {kind}, groups={self.groups.describe()}"
