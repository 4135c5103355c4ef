"""The one collective Ulysses needs: an all-to-all that trades a split of one dimension for a split of another.

    x on each of n ranks: [..., A, ..., B/n, ...]   (A split into n chunks, chunk r sent to rank r)
    result on each rank:  [..., A/n, ..., B, ...]   (the chunks received, concatenated along B in rank order)

Its adjoint is the same exchange with the two dimensions swapped, so backward is one more all-to-all of the
gradient: no rank ever holds the whole tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_zero.comm import all_to_all_single_

__all__ = ["seq_all_to_all"]


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world:
        raise ValueError(f"all-to-all over {world} ranks: dimension {scatter_dim} of a {tuple(x.shape)} tensor does "
                         f"not split evenly")
    # chunk r of scatter_dim goes to rank r: move scatter_dim to the front so each chunk is one contiguous block
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()  # [world, *chunk]
    recv = torch.empty_like(send)
    # bounded and checked like every hf_zero collective: a rank that never arrives ends the others with its name
    all_to_all_single_(recv, send, group=group, what=f"a sequence-parallel all-to-all of a {tuple(x.shape)} tensor")
    # recv[r] is rank r's chunk: it covers rank r's part of gather_dim
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over ``group``: ``scatter_dim`` shrinks by the group size, ``gather_dim`` grows."""
    return _SeqAllToAll.apply(x, group, scatter_dim, gather_dim)
