"""The two bulk collectives ZeRO is made of, on packed ``(world_size, span)`` buffers (see zero/layout.py).

torch renamed the single-tensor collectives (``*_tensor`` -> ``*_single``); both NCCL and gloo implement them in
the torch versions hf_zero supports, so there is no fallback path to maintain. A world of one skips the call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_packed", "all_gather_packed", "all_reduce_", "Work", "DoneWork"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DoneWork:
    """Stands in for a collective's handle when nothing had to be sent."""

    def wait(self) -> bool:
        return True


Work = object  # torch.distributed.Work or DoneWork: anything with .wait()


def reduce_scatter_packed(out: torch.Tensor, packed: torch.Tensor, group=None, async_op: bool = False):
    """``out`` (span,) = sum over ranks of row ``rank`` of ``packed`` (world_size, span)."""
    if packed.shape[0] == 1:
        out.copy_(packed[0])
        return DoneWork()
    work = _reduce_scatter(out, packed.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return work if async_op else DoneWork()


def all_gather_packed(packed: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """Row ``r`` of ``packed`` (world_size, span) = rank ``r``'s ``shard`` (span,)."""
    if packed.shape[0] == 1:
        packed[0].copy_(shard)
        return DoneWork()
    work = _all_gather(packed.view(-1), shard, group=group, async_op=async_op)
    return work if async_op else DoneWork()


def all_reduce_(tensor: torch.Tensor, group=None, async_op: bool = False, op=dist.ReduceOp.SUM):
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return DoneWork()
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work if async_op else DoneWork()
