"""Fake quantization of a linear layer's input, per tensor, with a dynamic or a static (EMA) range."""

from __future__ import annotations

import torch

from ..layer import InputTransform
from ..quant import qrange

__all__ = ["ActivationQuantizer"]


class ActivationQuantizer(InputTransform):
    def __init__(self, *, bits: int, offset: int, symmetric: bool, static: bool, momentum: float):
        super().__init__()
        self.target_bits = bits
        self.offset = offset
        self.symmetric = symmetric
        self.static = static
        self.momentum = momentum
        self.register_buffer("bits", torch.tensor(0, dtype=torch.int32))  # 0: not started
        self.register_buffer("range_min", torch.tensor(0.0))
        self.register_buffer("range_max", torch.tensor(0.0))
        self.register_buffer("calibrated", torch.tensor(False))

    def set_step(self, step: int) -> None:
        self.bits.fill_(self.target_bits if step >= self.offset else 0)

    def _range(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = x.detach().amin().float(), x.detach().amax().float()
        if not self.static:
            return lo, hi
        if self.training:
            if bool(self.calibrated):
                m = self.momentum
                self.range_min.mul_(m).add_((1 - m) * lo)
                self.range_max.mul_(m).add_((1 - m) * hi)
            else:
                self.range_min.copy_(lo)
                self.range_max.copy_(hi)
                self.calibrated.fill_(True)
        return self.range_min, self.range_max

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bits = int(self.bits)
        if bits == 0:
            return x
        lo, hi = self._range(x)
        qmin, qmax = qrange(bits, self.symmetric)
        if self.symmetric:
            scale = (torch.maximum(lo.abs(), hi.abs()) / qmax).clamp_min(1e-12)
            zero = torch.zeros_like(scale)
        else:
            lo, hi = lo.clamp_max(0.0), hi.clamp_min(0.0)
            scale = ((hi - lo) / (qmax - qmin)).clamp_min(1e-12)
            zero = torch.round(-lo / scale)
        q = (torch.clamp(torch.round(x.detach() / scale) + zero, qmin, qmax) - zero) * scale
        return x + (q.to(x.dtype) - x).detach()

    def stats(self) -> dict[str, float]:
        return {"act_bits": float(self.bits)}

    def extra_repr(self) -> str:
        return f"bits={int(self.bits)}, {'symmetric' if self.symmetric else 'asymmetric'}, " \
               f"{'static' if self.static else 'dynamic'}"
