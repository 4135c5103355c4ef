"""ZeRO's packed all-gather and reduce-scatter through the shared ring of shm_ring.py (ranks of one host, CPU).

Two ways, picked per call by :func:`~hf_zero.comm.collectives.all_gather_packed` / ``reduce_scatter_packed``:

- **in place** (all-gathers): the caller took its packed buffer from the ring (:func:`take_gather_buffer`), so its
  row is already where the other ranks read it. Issuing is one flag; waiting is waiting for the other ranks' flags.
  ZeRO-3's parameter gathers go this way: the gathered rows are unpacked straight from shared memory.
- **bounced** (reduce-scatters, and all-gathers of a private buffer): a gradient bucket is filled over much of a
  backward and would hold ring space all that time, and a buffer may be too large for the ring or turned down by
  it. At ``wait()`` the columns go through the ring in chunks of at most :data:`_BOUNCE_FRACTION` of it: this
  rank's part written in, flags, the result copied (or, for a reduce-scatter, summed) out.
- **delivered** (all-gathers of :func:`~hf_zero.comm.collectives.all_gather_delivered`): bounced, each chunk's
  rows handed to the caller straight from shared memory (stages 1-2 unpack them into the parameters), with no
  private packed buffer between.
- **filled** (reduce-scatters of :func:`~hf_zero.comm.collectives.reduce_scatter_filled`): bounced, but the chunks
  are written straight from where the caller's data lives (ZeRO-3's gradients, packed as they are copied in) and the
  sums go straight to where they are wanted (the gradient shards): no private packed bucket and no copy of it,
  where a bounced one pays one extra copy of this rank's part (against gloo's two socket copies per byte on each
  side).

Sums are taken in rank order on every rank, so a reduce-scatter gives the same bits every run. Every ring operation
happens in program order (issue or wait), which is the same on every rank, so the ring's offsets agree; a chunk the
ring turns down (the same answer on every rank) goes through gloo's per-row collectives instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import buffer_pool, faults, shm_ring

__all__ = ["take_gather_buffer", "give_packed", "shm_all_gather", "bounce_all_gather", "bounce_reduce_scatter",
           "fill_reduce_scatter", "deliver_to", "deliver_from", "delivered_all_gather"]

_BOUNCE_FRACTION = 8  # a bounced chunk's ring region: at most 1/8 of the ring


def take_gather_buffer(shape, dtype: torch.dtype, device, group=None, what: str = "a gather",
                       timeout_s: float | None = None, private_if_refused: bool = True) -> torch.Tensor | None:
    """The packed ``(world_size, span)`` buffer of an all-gather: shared memory where the group has a ring (its
    ranks share a host), else a private buffer (buffer_pool.py). Give it back with :func:`give_packed`.
    ``private_if_refused=False``: None where the group has a ring that turns the buffer down (too large for it; the
    same answer on every rank), for a caller that then gathers chunk by chunk (collectives.all_gather_delivered)."""
    ring = shm_ring.existing(group) if torch.device(device).type == "cpu" else None
    if ring is not None:
        t = ring.take_gather(tuple(shape), dtype, what, faults.timeout_s() if timeout_s is None else timeout_s)
        if t is not None or not private_if_refused:
            return t
    return buffer_pool.take(shape, dtype, device)


def give_packed(t: torch.Tensor | None, group=None) -> None:
    """Done with a buffer from :func:`take_gather_buffer` (or any other packed buffer): shared ones go back to the
    ring, private ones to buffer_pool. A view of shared memory is never pooled."""
    if t is None:
        return
    if shm_ring.give(t, group) or shm_ring.is_ring_memory(t):
        return
    buffer_pool.give(t)


def _seconds(timeout) -> float:
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
    return faults.timeout_s() if seconds is None else float(seconds)


class _ShmWork:
    """A collective in the ring: complete once every rank has published its part; ``then`` runs once, after."""

    def __init__(self, ring, region, what: str, then=None) -> None:
        self.ring, self.region, self.what, self.then = ring, region, what, then

    def wait(self, timeout=None) -> bool:
        self.ring.wait_ready(self.region, self.what, _seconds(timeout))
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self.ring.ready(self.region)


def shm_all_gather(ring, region, packed: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = True):
    """``packed`` is the ring's ``(world, span)`` buffer of ``region``: publish this rank's row."""
    row = packed[ring.rank]
    if shard.data_ptr() != row.data_ptr():
        row.copy_(shard)
    ring.publish(region)
    return _ShmWork(ring, region, "a shared-memory all-gather")


def _sum_rows(ring, blocks: torch.Tensor, out: torch.Tensor, lo: int, hi: int) -> None:
    """``out`` = sum over ranks j, in rank order, of ``blocks[j, rank, lo:hi]``."""
    r = ring.rank
    if ring.world == 1:
        out.copy_(blocks[0, r, lo:hi])
        return
    # the first two rows summed in one pass (read 2, write 1) instead of a copy and an add; the same bits
    torch.add(blocks[0, r, lo:hi], blocks[1, r, lo:hi], out=out)
    for j in range(2, ring.world):
        out.add_(blocks[j, r, lo:hi])


def _sum_rows_into(ring, blocks: torch.Tensor, dst: torch.Tensor, lo: int, hi: int, add: bool) -> None:
    """The sum of :func:`_sum_rows` written into ``dst`` (or added to it): straight there where ``dst`` has the
    buffer's dtype and is written, else summed apart in the buffer's dtype first -- the bits of summing into a packed
    result and copying or adding that, as every other path does."""
    if not add and dst.dtype == blocks.dtype:
        _sum_rows(ring, blocks, dst, lo, hi)
        return
    tmp = torch.empty(hi - lo, dtype=blocks.dtype)
    _sum_rows(ring, blocks, tmp, lo, hi)
    if add:
        dst.add_(tmp)
    else:
        dst.copy_(tmp)


def deliver_to(out: torch.Tensor):
    """The ``deliver`` of reduce_scatter_filled whose sums all go to one tensor ``out`` (span,)."""
    return lambda lo, hi, sum_into: sum_into(out[lo:hi], lo, hi)


def deliver_from(out: torch.Tensor, lo: int = 0):
    """The ``sum_into`` of reduce_scatter_filled over a materialized result ``out`` holding columns ``[lo, ...)``."""

    def sum_into(dst: torch.Tensor, a: int, b: int, add: bool = False) -> None:
        if add:
            dst.add_(out[a - lo:b - lo])
        else:
            dst.copy_(out[a - lo:b - lo])

    return sum_into


class _BounceWork:
    """Runs a bounced collective at ``wait()`` (see the module docstring); nothing moves before."""

    def __init__(self, run) -> None:
        self.run, self.done = run, False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.done = True
            self.run(_seconds(timeout))
        return True

    def is_completed(self) -> bool:
        return self.done


def _chunk_cols(ring, blocks: int, itemsize: int) -> int:
    return max(1, ring.size // (_BOUNCE_FRACTION * blocks * itemsize))


def bounce_all_gather(ring, what, packed: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = True):
    """A private packed buffer through the ring: :func:`delivered_all_gather` copying each chunk's rows into it."""
    return delivered_all_gather(ring, what, shard, lambda lo, hi, rows: packed[:, lo:hi].copy_(rows),
                                tuple(packed.shape), packed.dtype, group)


def delivered_all_gather(ring, what, shard: torch.Tensor, deliver, shape, dtype: torch.dtype, group=None,
                         async_op: bool = True):
    """An all-gather of ``shard`` whose rows go wherever ``deliver(lo, hi, rows)`` puts them (see
    collectives.all_gather_delivered): at ``wait()``, chunk by chunk, this rank's columns are copied into the ring
    and every rank's ``(world, hi - lo)`` rows handed to ``deliver`` straight from shared memory."""
    what = what or "an all-gather"
    w, span = shape
    step = _chunk_cols(ring, w, dtype.itemsize)

    def run(timeout_s: float) -> None:
        for lo in range(0, span, step):
            hi = min(span, lo + step)
            buf = ring.take_gather((w, hi - lo), dtype, what, timeout_s)
            if buf is None:  # turned down on every rank alike: the rest through gloo, into a private buffer
                packed = torch.empty((w, span - lo), dtype=dtype)
                _gloo_rows_gather(packed, shard[lo:], group, ring.rank)
                deliver(lo, span, packed)
                return
            region = ring.region_of(buf)
            buf[ring.rank].copy_(shard[lo:hi])
            ring.publish(region)
            ring.wait_ready(region, what, timeout_s)
            deliver(lo, hi, buf)
            ring.give(buf)

    return _BounceWork(run)


def bounce_reduce_scatter(ring, what, out: torch.Tensor, packed: torch.Tensor, group=None, async_op: bool = True):
    """A private packed buffer through the ring: :func:`fill_reduce_scatter` copying its columns in, and each
    chunk's sums out into ``out``."""
    return fill_reduce_scatter(ring, what, lambda dst, lo: dst.copy_(packed[:, lo:lo + dst.shape[1]]),
                               deliver_to(out), tuple(packed.shape), packed.dtype, group)


def fill_reduce_scatter(ring, what, fill, deliver, shape, dtype: torch.dtype, group=None, async_op: bool = True, *,
                        filled=None):
    """A reduce-scatter of a ``shape = (world, span)`` packed buffer that exists only as ``fill`` (see
    collectives.reduce_scatter_filled): at ``wait()``, chunk by chunk, ``fill`` writes this rank's columns straight
    into its block of the ring and ``deliver`` takes each chunk's sums from the shared rows; ``filled()`` after the
    last chunk's fill."""
    what = what or "a reduce-scatter"
    w, span = shape
    step = _chunk_cols(ring, w * w, dtype.itemsize)

    def run(timeout_s: float) -> None:
        for lo in range(0, span, step):
            hi = min(span, lo + step)
            buf = ring.take_reduce((w, hi - lo), dtype, what, timeout_s)
            if buf is None:  # turned down on every rank alike: the rest through gloo, from a private buffer
                packed = torch.empty((w, span - lo), dtype=dtype)
                fill(packed, lo)
                if filled is not None:
                    filled()
                out = torch.empty(span - lo, dtype=dtype)
                _gloo_rows_reduce(out, packed, group, ring.rank)
                deliver(lo, span, deliver_from(out, lo))
                return
            region = ring.region_of(buf)
            fill(buf, lo)
            if hi == span and filled is not None:
                filled()
            ring.publish(region)
            ring.wait_ready(region, what, timeout_s)
            deliver(lo, hi, lambda dst, a, b, add=False, lo=lo: _sum_rows_into(ring, region.view, dst, a - lo, b - lo,
                                                                               add))
            ring.give(buf)

    return _BounceWork(run)


def _gloo_rows_gather(packed: torch.Tensor, shard: torch.Tensor, group, rank: int) -> None:
    packed[rank].copy_(shard)
    for r in range(packed.shape[0]):
        row = packed[r].contiguous()
        dist.broadcast(row, src=_global(group, r), group=group)
        packed[r].copy_(row)


def _gloo_rows_reduce(out: torch.Tensor, packed: torch.Tensor, group, rank: int) -> None:
    for r in range(packed.shape[0]):
        row = packed[r].contiguous()
        dist.reduce(row, dst=_global(group, r), op=dist.ReduceOp.SUM, group=group)
        if r == rank:
            out.copy_(row)


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)
