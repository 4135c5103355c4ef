"""How parameters are cut into per-rank shards. One layout serves ZeRO stages 1, 2 and 3 and checkpoint resharding.

Every parameter is flattened and cut into ``world_size`` equal shards of ``shard_numel = ceil(numel / world_size)``
elements (the last shards zero-padded). Rank ``r`` owns shard ``r`` of every parameter. A rank's *flat shard* of a
group of parameters is the concatenation of its shards, in parameter order::

    param p (numel 5), q (numel 3), world_size 2:      p -> shards [p0 p1 p2] [p3 p4 _ ]
                                                       q -> shards [q0 q1]    [q2 _ ]
    rank 0 flat shard: [p0 p1 p2 q0 q1]                rank 1 flat shard: [p3 p4 _ q2 _]

Why per-parameter shards rather than one flat buffer cut in N (DeepSpeed's stage 1/2 layout): every rank's shard
of every bucket has the same size, so a bucket's gradients reduce-scatter with one equal-split collective
(``reduce_scatter_tensor`` on NCCL and gloo alike), the same shard serves stage 3's per-module gathers, and a
checkpoint written on N ranks can be re-cut for M ranks from the per-parameter shards alone.

Words: a rank's piece of a tensor is its *shard*, everywhere in hf_zero (a parameter's shard, a group's flat shard);
*partitioned* is the state of a parameter that is cut into shards (DeepSpeed's word, kept in its API names).

A *packed* buffer of shape ``(world_size, span)`` holds, in row ``r``, rank ``r``'s shard of a contiguous range of
parameters: the input of a reduce-scatter and the output of an all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hf_zero.comm.buckets import BUCKET_CAP_BYTES, capped_bucket_numel

__all__ = ["ShardLayout", "param_shard_numel", "BUCKET_CAP_BYTES", "capped_bucket_numel"]


def param_shard_numel(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


@dataclass(frozen=True)
class ShardLayout:
    """Shard sizes and shard offsets of an ordered list of parameters over ``world_size`` ranks."""

    numels: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        shard_numels = tuple(param_shard_numel(n, self.world_size) for n in self.numels)
        offsets = [0]
        for c in shard_numels:
            offsets.append(offsets[-1] + c)
        object.__setattr__(self, "shard_numels", shard_numels)
        object.__setattr__(self, "offsets", tuple(offsets))

    shard_numels: tuple[int, ...] = ()  # filled in __post_init__: param_shard_numel of each parameter
    offsets: tuple[int, ...] = ()  # len(numels) + 1 offsets of each parameter's shard inside a rank's flat shard

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's flat shard (padding included)."""
        return self.offsets[-1]

    def span(self, start: int, stop: int) -> tuple[int, int]:
        """Shard offsets ``[lo, hi)`` of the parameters ``start..stop-1``."""
        return self.offsets[start], self.offsets[stop]

    def owned_range(self, index: int, rank: int) -> tuple[int, int]:
        """Which elements ``[lo, hi)`` of the flattened parameter ``index`` rank ``rank`` owns (may be empty)."""
        c = self.shard_numels[index]
        lo = min(rank * c, self.numels[index])
        return lo, min(lo + c, self.numels[index])

    def pack(self, flats: Sequence[torch.Tensor], start: int, out: torch.Tensor, scale: float | None = None) -> None:
        """Write the flattened tensors of parameters ``start..start+len(flats)-1`` into ``out`` (world_size, span).

        ``scale`` multiplies on the way in (gradient pre-division). Padding positions are zeroed.
        """
        self.pack_columns(flats, start, out, 0, scale)

    def pack_columns(self, flats: Sequence[torch.Tensor], start: int, out: torch.Tensor, lo: int,
                     scale: float | None = None) -> None:
        """Columns ``[lo, lo + out.shape[1])`` of what :meth:`pack` writes, into ``out`` (world_size, n): a packed
        buffer filled chunk by chunk where it is never whole (comm/collectives.reduce_scatter_filled)."""
        base = self.offsets[start]
        hi = lo + out.shape[1]
        for i, flat in enumerate(flats, start):
            o, c = self.offsets[i] - base, self.shard_numels[i]
            a, b = max(lo, o), min(hi, o + c)
            if a < b:
                self._copy_columns(out[:, a - lo:b - lo], flat, self.numels[i], c, a - o, b - o, scale)

    def unpack(self, packed: torch.Tensor, start: int, outs: Sequence[torch.Tensor]) -> None:
        """Inverse of :meth:`pack`: copy each parameter's shards out of ``packed`` into its flat tensor in ``outs``."""
        self.unpack_columns(packed, start, outs, 0)

    def unpack_columns(self, cols: torch.Tensor, start: int, outs: Sequence[torch.Tensor], lo: int) -> None:
        """Columns ``[lo, lo + cols.shape[1])`` of a packed buffer, ``cols`` (world_size, n), into the flat tensors
        ``outs`` of parameters ``start..``: the inverse of :meth:`pack_columns` (padding is dropped)."""
        base = self.offsets[start]
        hi = lo + cols.shape[1]
        for i, flat in enumerate(outs, start):
            o, c, n = self.offsets[i] - base, self.shard_numels[i], self.numels[i]
            a, b = max(lo, o), min(hi, o + c)
            if a >= b:
                continue
            block = cols[:, a - lo:b - lo]  # (world_size, b - a): columns [a - o, b - o) of the parameter's shards
            a, b = a - o, b - o
            full_rows = n // c
            if full_rows:
                flat[:full_rows * c].view(full_rows, c)[:, a:b].copy_(block[:full_rows])
            rem = n - full_rows * c
            if rem and a < rem:
                flat[full_rows * c + a:full_rows * c + min(b, rem)].copy_(block[full_rows, :min(b, rem) - a])

    def shard_of(self, flat: torch.Tensor, index: int, rank: int, out: torch.Tensor) -> None:
        """Copy rank ``rank``'s shard of the flattened parameter ``index`` into ``out`` (shard_numel, zero-padded)."""
        lo, hi = self.owned_range(index, rank)
        out[:hi - lo].copy_(flat[lo:hi])
        out[hi - lo:].zero_()

    @staticmethod
    def _copy_columns(block: torch.Tensor, flat: torch.Tensor, n: int, c: int, a: int, b: int,
                      scale: float | None) -> None:
        # block: (world_size, b - a), columns [a, b) of the parameter's (world_size, c) shards, zero-padded; flat: (n,)
        full_rows = n // c
        if full_rows:
            src, dst = flat[:full_rows * c].view(full_rows, c)[:, a:b], block[:full_rows]
            if scale is None:
                dst.copy_(src)
            elif src.dtype == dst.dtype:
                torch.mul(src, scale, out=dst)  # one pass: scale while copying
            else:
                dst.copy_(src).mul_(scale)  # cast first, then scale in the buffer's dtype
        rem = n - full_rows * c
        row = full_rows
        if rem:  # the last, partly filled shard: values up to column rem, padding after
            if a < rem:
                dst = block[row, :min(b, rem) - a]
                dst.copy_(flat[full_rows * c + a:full_rows * c + min(b, rem)])
                if scale is not None:
                    dst.mul_(scale)
            if b > rem:
                block[row, max(rem - a, 0):].zero_()
            row += 1
        if row < block.shape[0]:
            block[row:].zero_()
