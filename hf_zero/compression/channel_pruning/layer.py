"""The hidden-channel mask of a decoder LM: one mask over the residual stream, shared by every module that writes
into it.

Invariant: a pruned channel is zero in the residual stream at every layer. The token embedding's output is masked
(forward hook) and every writer (attention output and MLP down projections) has its output rows masked, so nothing
ever adds to a pruned channel. Then RMSNorm outputs are zero there too, and every reader (q/k/v, gate/up, lm_head)
multiplies zeros by its pruned input columns -- removing them later changes nothing. The one thing that does change
on removal is RMSNorm's mean over channels (H before, K after): cleaning folds sqrt(H / K) into the norm weights
and scales the norm's epsilon by H / K, which is exact.

State: the :class:`ChannelMask` owner is the ``channel_pruning`` transform of the first writer and holds the
buffers (a :class:`~hf_zero.compression.masking.DensityMask`'s); the other writers hold a :class:`ChannelRows`
that reads the owner's mask through a plain reference, so the state dict has one copy.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layer import WeightTransform, full_parameters
from ..masking import DensityMask, top_units
from ..schedule import DensitySchedule

__all__ = ["ChannelMask", "ChannelRows"]


class ChannelMask(DensityMask):
    def __init__(self, *, hidden: int, schedule: DensitySchedule, scored: list[tuple[nn.Parameter, int]]):
        super().__init__(hidden)
        self.hidden = hidden
        self.schedule = schedule
        # (parameter, channel axis) of every tensor that reads or writes the residual stream: the l1 importance
        self._scored = scored
        self._handles: list = []

    @torch.no_grad()
    def importance(self) -> torch.Tensor:
        """(hidden,) sum over tensors of each channel's L1 norm, each tensor normalized by its mean |w| so no single
        large matrix decides alone."""
        score = torch.zeros(self.hidden, dtype=torch.float32, device=self.mask.device)
        for param, axis in self._scored:
            with full_parameters([param]):  # one tensor at a time: ZeRO-3 never holds the whole model
                a = param.detach().abs().float()
                per_channel = a.sum(dim=1 - axis) if a.dim() == 2 else a
                score += (per_channel / a.mean().clamp_min(1e-12)).to(score.device)
        return score

    def set_step(self, step: int) -> None:
        target = self.schedule.at(step)
        self.target_density.fill_(target)
        if float(self.density) != target:
            self.mask.copy_(top_units(self.importance(), target))
            self.density.fill_(target)

    def forward(self, weight: torch.Tensor, bias: torch.Tensor | None):
        return _mask_rows(self.mask, weight, bias)

    def embedding_hook(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
        if bool(self.mask.all()):
            return None
        return output * self.mask.to(output.dtype)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, density={float(self.density):.3f}"


class ChannelRows(WeightTransform):
    """Masks a writer's output rows with the owner's mask; no state of its own."""

    def __init__(self, owner: ChannelMask):
        super().__init__()
        self._owner = [owner]  # a list, so nn.Module does not register (and save) the owner twice

    def set_step(self, step: int) -> None:
        """The owner moves the schedule; nothing to do here."""

    def forward(self, weight: torch.Tensor, bias: torch.Tensor | None):
        return _mask_rows(self._owner[0].mask, weight, bias)


def _mask_rows(mask: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if bool(mask.all()):
        return weight, bias
    m = mask.to(weight.dtype)
    return weight * m[:, None], (None if bias is None else bias * m)
