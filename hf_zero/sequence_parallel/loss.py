"""The loss of a sequence split over the SP ranks: each rank's mean over its shard's tokens, weighted back into the
mean over the whole sequence.

    rank r: loss_r = mean over its n_r counted tokens (shift_labels != -100)
    every rank: loss = sum_r(loss_r * n_r) / sum_r(n_r)   -- the single-process loss of the full sequence

The per-rank losses are exchanged with a differentiable all-gather, so every rank holds the same full loss and
backpropagates it; the all-gather's backward sums the ``sp_size`` identical seeds. hf_zero's engine averages the
gradients over every rank (SP x DP), which divides that factor out again: the gradient is the single-process
gradient of the full-sequence mean loss (DeepSpeed 0.19.8 divides by the DP size only, so its gradient is
``sp_size`` times that; see tests/test_sequence_parallel.py). This is the aggregation accelerate's and
transformers' Ulysses paths perform themselves; a script of its own calls :func:`sequence_parallel_loss`.
"""

from __future__ import annotations

import torch
import torch.distributed.nn.functional as dist_nn

from hf_zero.sequence_parallel.dataloader import IGNORE_INDEX

__all__ = ["sequence_parallel_loss"]


def sequence_parallel_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group) -> torch.Tensor:
    """The full sequence's mean loss from this rank's shard mean ``loss`` and its ``shift_labels`` (differentiable;
    collective over ``group``, the SP group). A shard with no counted token contributes nothing, even if its mean
    is NaN."""
    counted = (shift_labels != IGNORE_INDEX).sum().to(loss.dtype)
    losses = torch.stack(dist_nn.all_gather(loss.reshape(()), group=group))
    counts = torch.stack(dist_nn.all_gather(counted, group=group))
    weighted = torch.where(counts > 0, losses * counts, torch.zeros_like(losses))
    return weighted.sum() / counts.sum().clamp(min=1)
