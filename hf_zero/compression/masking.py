"""A pruning mask over *units* of a linear weight: single elements (unstructured), output rows (neurons), or
blocks of input columns (attention heads). One class, so every pruning method has the same schedule, resume and
fold behaviour.

State: every pruning mask's (:class:`DensityMask`, which the channel mask shares). A UnitMask recomputes its mask
lazily, in the forward pass -- i.e. from the weight as it is at forward time (under ZeRO-3 the gathered one).

Methods: ``l1`` ranks units by the L1 norm of their weights; ``topk`` learns a score per unit (initialized to
that L1 norm) and keeps the top ``density`` share, with a straight-through gradient to the scores
(Sanh et al., 2020, as in DeepSpeed's TopKBinarizer).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from .layer import WeightTransform, full_parameters
from .schedule import DensitySchedule

__all__ = ["DensityMask", "UnitMask", "top_units"]

Axis = Literal["element", "row", "col"]


def top_units(importance: torch.Tensor, density: float) -> torch.Tensor:
    """Bool mask keeping the ``round(density * n)`` (at least one) most important units."""
    n = importance.numel()
    keep = max(1, int(round(density * n)))
    mask = torch.zeros(n, dtype=torch.bool, device=importance.device)
    mask[torch.topk(importance.float(), keep, sorted=False).indices] = True
    return mask


class _TopKBinarizer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, density: float) -> torch.Tensor:
        return top_units(scores.detach(), density).to(scores.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class DensityMask(WeightTransform):
    """What every pruning mask keeps, all saved with the model: ``mask`` (bool, one entry per unit), ``density``
    (the density ``mask`` was computed for) and ``target_density`` (what the schedule wants now). A subclass
    recomputes ``mask`` when the two differ and never otherwise, so a resumed run keeps the exact mask it saved."""

    def __init__(self, num_units: int, device: torch.device | None = None):
        super().__init__()
        self.register_buffer("mask", torch.ones(num_units, dtype=torch.bool, device=device))
        self.register_buffer("density", torch.tensor(1.0))
        self.register_buffer("target_density", torch.tensor(1.0))

    def kept_units(self) -> torch.Tensor:
        """Indices of the kept units, ascending (what redundancy_clean keeps)."""
        return self.mask.nonzero().flatten()

    def stats(self) -> dict[str, float]:
        return {"density": float(self.mask.float().mean())}


class UnitMask(DensityMask):
    def __init__(self, *, weight: torch.Tensor, axis: Axis, num_units: int, method: Literal["l1", "topk"],
                 schedule: DensitySchedule, mask_bias: bool):
        super().__init__(num_units, device=weight.device)
        self.axis = axis
        self.num_units = num_units
        self.method = method
        self.schedule = schedule
        self.mask_bias = mask_bias and axis == "row"
        if method == "topk":
            with full_parameters([weight]):
                self.scores = nn.Parameter(self.importance(weight.detach()).float().clone())

    def importance(self, weight: torch.Tensor) -> torch.Tensor:
        """(num_units,) L1 norm of each unit's weights."""
        a = weight.abs()
        if self.axis == "element":
            return a.flatten()
        if self.axis == "row":
            return a.sum(1).view(self.num_units, -1).sum(1)
        return a.sum(0).view(self.num_units, -1).sum(1)

    def expand(self, unit_mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Unit mask (num_units,) -> broadcastable against the weight (out, in)."""
        if self.axis == "element":
            return unit_mask.view(weight.shape)
        if self.axis == "row":
            return unit_mask.repeat_interleave(weight.shape[0] // self.num_units)[:, None]
        return unit_mask.repeat_interleave(weight.shape[1] // self.num_units)[None, :]

    def set_step(self, step: int) -> None:
        self.target_density.fill_(self.schedule.at(step))

    def _current_mask(self, weight: torch.Tensor) -> torch.Tensor | None:
        target = float(self.target_density)
        if self.method == "topk":
            if target >= 1.0:
                return None
            soft = _TopKBinarizer.apply(self.scores, target)
            self.mask.copy_(soft.detach().bool())
            self.density.fill_(target)
            return soft.to(weight.dtype)
        if float(self.density) != target:
            self.mask.copy_(top_units(self.importance(weight.detach()), target))
            self.density.fill_(target)
        if bool(self.mask.all()):
            return None
        return self.mask.to(weight.dtype)

    def forward(self, weight: torch.Tensor, bias: torch.Tensor | None):
        unit_mask = self._current_mask(weight)
        if unit_mask is None:
            return weight, bias
        weight = weight * self.expand(unit_mask, weight)
        if self.mask_bias and bias is not None:
            bias = bias * unit_mask.repeat_interleave(bias.shape[0] // self.num_units)
        return weight, bias

    def extra_repr(self) -> str:
        return f"axis={self.axis}, units={self.num_units}, method={self.method}, density={float(self.density):.3f}"
