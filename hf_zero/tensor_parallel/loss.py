"""Vocabulary-parallel cross-entropy: the loss of logits sharded over the vocabulary, without full logits anywhere.

Rank ``r`` of the TP group holds logits ``(N, V_r)`` for its vocabulary slice ``[start_r, start_r + V_r)``. The
softmax denominator and the target's logit are sums over the vocabulary, so each is a local partial sum plus one
all-reduce; the global max (for a stable exp) is a MAX all-reduce. The backward needs no communication: the
gradient of the local logits is ``softmax_local - onehot_local`` (the one-hot is zero outside this rank's slice).
Per token that is two collectives of ``N`` floats instead of gathering ``N x V`` logits, each through hf_zero's
bounded, checked layer (comm/collectives.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hf_zero.comm import all_reduce_

__all__ = ["vocab_parallel_cross_entropy", "VocabParallelCausalLMLoss"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, group, ignore_index: int):
        # logits (N, V_r) fp32, this rank's vocabulary slice; target (N,) global token ids
        width = logits.shape[-1]
        row_max = logits.detach().amax(dim=-1)
        # bounded and checked like every hf_zero collective (comm/collectives.py): a TP rank that died or stopped
        # is named within comms_timeout_s
        all_reduce_(row_max, group=group, op=dist.ReduceOp.MAX, what="the vocabulary-parallel loss's row maxima")
        shifted = logits - row_max.unsqueeze(-1)
        valid = target != ignore_index
        local = target - vocab_start
        mine = valid & (local >= 0) & (local < width)
        local = torch.where(mine, local, torch.zeros_like(local))
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine])
        # (2, N): softmax denominator, target logit
        all_reduce_(sums, group=group, what="the vocabulary-parallel loss's sums")
        loss = torch.where(valid, sums[0].log() - sums[1], torch.zeros_like(sums[0]))
        exp.div_(sums[0].unsqueeze(-1))  # softmax over the full vocabulary, this rank's columns
        ctx.save_for_backward(exp, local, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine, valid = ctx.saved_tensors
        grad = softmax.clone()  # the saved softmax stays intact for a retain_graph second backward
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= mine.to(grad.dtype)
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                                 reduction: str = "mean", group=None, vocab_start: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target)`` computed from vocabulary shards.

    ``logits``: a DTensor sharded on its last dim (what a vocabulary-parallel LM head returns), or this rank's
    local ``(..., V_r)`` slice together with ``group`` and ``vocab_start``. ``target``: global ids, ``logits``'
    shape without the last dim. ``reduction``: "mean" (over non-ignored targets), "sum" or "none".
    """
    if isinstance(logits, DTensor):
        placements = logits.placements
        if len(placements) != 1 or not (isinstance(placements[0], Shard)
                                        and placements[0].dim in (-1, logits.ndim - 1)):
            raise ValueError(f"hf_zero: vocab_parallel_cross_entropy needs logits sharded on the vocabulary (last) "
                             f"dim, got placements {placements}")
        mesh = logits.device_mesh
        group = mesh.get_group()
        chunk = -(-logits.shape[-1] // mesh.size())  # torch.chunk's split: every rank but the last holds `chunk`
        vocab_start = min(mesh.get_local_rank() * chunk, logits.shape[-1])
        logits = logits.to_local()
    elif group is None or vocab_start is None:
        raise ValueError("hf_zero: vocab_parallel_cross_entropy got a plain tensor: pass group= and vocab_start= "
                         "(or the DTensor the vocabulary-parallel LM head returns)")
    flat = logits.float().reshape(-1, logits.shape[-1])
    per_token = _VocabParallelCE.apply(flat, target.reshape(-1).to(flat.device), vocab_start, group, ignore_index)
    if reduction == "none":
        return per_token.view(target.shape)
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        return per_token.sum() / (target != ignore_index).sum()
    raise ValueError(f"hf_zero: reduction={reduction!r} is not one of 'mean', 'sum', 'none'")


class VocabParallelCausalLMLoss:
    """transformers' ``ForCausalLMLoss`` (shift by one, ignore -100, mean or sum / num_items_in_batch) over
    vocabulary-sharded logits; installed as ``model.loss_function`` by :func:`~hf_zero.tensor_parallel.apply_tp`."""

    def __call__(self, logits, labels, vocab_size: int | None = None, num_items_in_batch=None,
                 ignore_index: int = -100, shift_labels=None, **kwargs) -> torch.Tensor:
        if shift_labels is None:
            labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss
