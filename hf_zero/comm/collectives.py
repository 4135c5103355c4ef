"""The two bulk collectives ZeRO is made of, on packed ``(world_size, span)`` buffers (see zero/layout.py), the
all-reduce and the all-to-all of MoE tokens, each bounded and checked (see faults.py).

torch renamed the single-tensor collectives (``*_tensor`` -> ``*_single``); both NCCL and gloo implement them in
the torch versions hf_zero supports, so there is no fallback path to maintain. A world of one skips the call.

Every call is preceded by the divergence check (one small all-gather; ``comms_divergence_check``) and returns a
:class:`BoundedWork`, whose ``wait()`` is bounded by ``comms_timeout_s``; a synchronous call waits the same way.
``what`` names the collective in errors ("the gather of model.layers.3", "the gradient reduce-scatter of ...").

With the comms logger on (comms_log.py), ``_issue`` -- every collective here passes through it -- times the payload
from the moment it leaves to the end of its handle's ``wait()``, and records it under its kind (``all_gather``,
``reduce_scatter``, ``all_reduce``; ``all_to_all_single``, ``barrier``: DeepSpeed's names for those two).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from . import buffer_pool, comms_log, faults, shm_ring
from .process_group import backend_for, bookkeeping_device
from .shm_collectives import (bounce_all_gather, bounce_reduce_scatter, deliver_from, deliver_to,
                              delivered_all_gather, fill_reduce_scatter, shm_all_gather)

__all__ = ["reduce_scatter_packed", "reduce_scatter_filled", "all_gather_packed", "all_gather_delivered",
           "all_reduce_", "all_to_all_single_", "barrier", "Work", "DoneWork", "BoundedWork"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DoneWork:
    """Stands in for a collective's handle when nothing had to be sent."""

    def wait(self, timeout=None) -> bool:
        return True


class BoundedWork:
    """A collective in flight; ``wait()`` ends in at most the configured timeout (or the diagnosed CommFault)."""

    def __init__(self, work, what: str, group, stream_ordered: bool = False) -> None:
        self.work, self.what, self.group = work, what, group  # work: None until a deferred check lets it leave
        self.stream_ordered = stream_ordered  # CUDA tensors: NCCL's wait orders streams, the host does not block
        self._done = False

    def wait(self, timeout=None) -> bool:
        if self.work is None:
            faults.settle(self.group)
        if not self._done:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
            faults.bounded_wait(self.work, self.what, self.group, seconds, stream_ordered=self.stream_ordered)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or (self.work is not None and self.work.is_completed())


Work = object  # BoundedWork or DoneWork: anything with .wait()


def _issue(kind: str, fn, tensor: torch.Tensor, what: str | None, group, async_op: bool, *args,
           force_check: bool = False, defer_check: bool = False, log_name: str | None = None, **kwargs):
    """``tensor``: what the divergence check compares (its element count and dtype) -- the packed buffer, or the
    :class:`_Spec` of one that is never materialized. ``log_name``: the comms logger's name for it, which also picks
    its bandwidth formula (default: ``kind``)."""
    numel, dtype = tensor.numel(), tensor.dtype
    what = what or f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} of {numel} elements"
    timing = _timing(kind, log_name or kind, tensor, group) if comms_log.logger.enabled else None
    faults.settle(group)  # a deferred payload asked for before this one leaves first
    # NCCL's wait orders streams instead of blocking the host; gloo's host copies of CUDA tensors wait as CPU work
    on_gpu = tensor.device.type == "cuda" and backend_for("cuda", group) != "gloo"
    if async_op and defer_check:
        bounded = BoundedWork(None, what, group, on_gpu)

        def issue() -> None:
            bounded.work = _leave(fn, args, kwargs, what, group, timing)

        if faults.check_deferred(kind, numel, dtype, what, issue, group, force=force_check):
            return bounded
    faults.check_collective(kind, numel, dtype, what, group, force=force_check)
    bounded = BoundedWork(_leave(fn, args, kwargs, what, group, timing), what, group, on_gpu)
    if not async_op:
        bounded.wait()
        return DoneWork()
    return bounded


def _leave(fn, args, kwargs, what: str, group, timing: comms_log.Timing | None):
    """Issue the payload; profiled, its handle records it once waited on (by BoundedWork.wait or any caller that
    waits on ``BoundedWork.work`` itself -- faults.bounded_wait always ends in the handle's ``wait()``)."""
    if timing is not None:
        timing.start()
    with faults.bounded(f"issuing {what}", group):
        work = fn(*args, group=group, async_op=True, **kwargs)
    return work if timing is None else comms_log.TimedWork(work, timing)


def _timing(kind: str, log_name: str, tensor, group) -> comms_log.Timing | None:
    """The comms logger's timing of one collective, not started (None: not profiled). The message is what this rank
    puts in: an all-gather's shard (a row of the ``(world_size, span)`` buffer), every other kind's whole tensor."""
    nbytes = tensor.numel() * tensor.dtype.itemsize
    if kind == "all_gather":
        nbytes //= tensor.shape[0]
    return comms_log.logger.timing(log_name, log_name, nbytes, group, tensor.device)


def reduce_scatter_packed(out: torch.Tensor, packed: torch.Tensor, group=None, async_op: bool = False,
                          what: str | None = None, defer_check: bool = False):
    """``out`` (span,) = sum over ranks of row ``rank`` of ``packed`` (world_size, span). ``defer_check`` (with
    ``async_op``): see faults.check_deferred -- the collective may leave only at the next one or at ``wait()``.
    ``packed`` is scratch: its rows may hold anything afterwards (on gloo, see :func:`_row_reduces`)."""
    if packed.shape[0] == 1:
        out.copy_(packed[0])
        return DoneWork()
    ring = shm_ring.existing(group) if packed.device.type == "cpu" else None
    if ring is not None:  # one host: bounced through shared memory at wait() (shm_collectives.py)
        return _issue("reduce_scatter", bounce_reduce_scatter, packed, what, group, async_op, ring, what, out, packed,
                      defer_check=defer_check)
    return _issue("reduce_scatter", _reduce_scatter_any, packed, what, group, async_op, out, packed,
                  defer_check=defer_check)


def _reduce_scatter_any(out: torch.Tensor, packed: torch.Tensor, group=None, async_op: bool = True):
    """The payload of a reduce-scatter off the shared ring, by backend and device."""
    if _by_rows(packed, group):
        return _row_reduces(out, packed, group)
    if _gloo_on_gpu(packed, group):
        return _host_reduce_scatter(out, packed, group)
    return _reduce_scatter(out, packed.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=True)


class _Spec(NamedTuple):
    """What the divergence check and the wait need of a packed buffer that is never materialized."""

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def reduce_scatter_filled(fill, shape: tuple[int, int], dtype: torch.dtype, device, *, deliver=None,
                          out: torch.Tensor | None = None, filled=None, group=None, what: str | None = None,
                          defer_check: bool = False):
    """An asynchronous :func:`reduce_scatter_packed` of a ``shape = (world_size, span)`` packed buffer given as a
    function, so that it need not exist whole. ``fill(dst, lo)`` writes columns ``[lo, lo + dst.shape[1])`` of this
    rank's packed buffer into ``dst`` (world_size, n). The sums go to ``out`` (span,), or, where they go to several
    places, to ``deliver(lo, hi, sum_into)``, called in column order once the sums of columns ``[lo, hi)`` are known:
    ``sum_into(dst, a, b, add=False)`` writes the sum over ranks of columns ``[a, b)`` (``lo <= a < b <= hi``) into
    ``dst``, or adds it with ``add`` (computed apart first: the bits of adding a reduced buffer). ``filled()``, if
    given, is called once the whole packed buffer has been filled: what ``fill`` reads may be freed from then on.

    Through a shared ring (ranks of one host, CPU) the buffer never exists: at ``wait()`` it is filled chunk by chunk
    straight into shared memory and summed straight out of it (shm_collectives.fill_reduce_scatter), which saves a
    copy of the bucket in and one of the result out (``filled`` runs inside ``wait()``). Elsewhere it is filled into
    a pooled buffer when the collective is issued and reduce-scattered into ``out`` (or a pooled result that
    ``wait()`` delivers); ``filled`` runs right after, so the inputs need not outlive the issue (on a GPU: the
    gradients are not held beside their packed copy while it is in flight). ``fill``, ``filled`` and ``deliver``
    run on the calling thread, inside the call, a later collective or ``wait()``."""
    assert (deliver is None) != (out is None), "reduce_scatter_filled: give either deliver or out"
    if deliver is None:
        deliver = deliver_to(out)
    device = torch.device(device)
    if shape[0] == 1:  # a world of one: its own row is the sum
        packed = buffer_pool.take(shape, dtype, device)
        fill(packed, 0)
        if filled is not None:
            filled()
        deliver(0, shape[1], deliver_from(packed[0]))
        buffer_pool.give(packed)
        return DoneWork()
    spec = _Spec(tuple(shape), dtype, device)
    ring = shm_ring.existing(group) if device.type == "cpu" else None
    if ring is not None:
        return _issue("reduce_scatter", fill_reduce_scatter, spec, what, group, True, ring, what, fill, deliver,
                      spec.shape, dtype, filled=filled, defer_check=defer_check)
    return _issue("reduce_scatter", _fill_then_reduce_scatter, spec, what, group, True, fill, deliver, out, spec,
                  filled, defer_check=defer_check)


def _fill_then_reduce_scatter(fill, deliver, out, spec: _Spec, filled, group=None,
                              async_op: bool = True) -> "_RowWorks":
    packed = buffer_pool.take(spec.shape, spec.dtype, spec.device)
    fill(packed, 0)
    if filled is not None:
        filled()
    result = out if out is not None else buffer_pool.take(spec.shape[1], spec.dtype, spec.device)
    work = _reduce_scatter_any(result, packed, group)

    def then() -> None:
        if out is None:
            deliver(0, spec.shape[1], deliver_from(result))
            buffer_pool.give(result)
        buffer_pool.give(packed)

    return _RowWorks([work], then)


def all_gather_packed(packed: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False,
                      what: str | None = None, force_check: bool = False, defer_check: bool = False):
    """Row ``r`` of ``packed`` (world_size, span) = rank ``r``'s ``shard`` (span,). ``force_check``: check even
    when ``comms_divergence_check`` is off. ``defer_check``: as for :func:`reduce_scatter_packed`."""
    if packed.shape[0] == 1:
        packed[0].copy_(shard)
        return DoneWork()
    ring = shm_ring.existing(group) if packed.device.type == "cpu" else None
    if ring is not None:  # one host: through shared memory (shm_collectives.py)
        region = ring.region_of(packed)
        fn, first = (shm_all_gather, region) if region is not None else (bounce_all_gather, what)
        return _issue("all_gather", fn, packed, what, group, async_op, ring, first, packed, shard,
                      force_check=force_check, defer_check=defer_check)
    return _issue("all_gather", _all_gather_any, packed, what, group, async_op, packed, shard,
                  force_check=force_check, defer_check=defer_check)


def _all_gather_any(packed: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = True):
    """The payload of an all-gather off the shared ring, by backend and device."""
    if _by_rows(packed, group):
        return _row_broadcasts(packed, shard, group)
    if _gloo_on_gpu(packed, group):
        return _host_all_gather(packed, shard, group)
    return _all_gather(packed.view(-1), shard, group=group, async_op=True)


def all_gather_delivered(shard: torch.Tensor, deliver, group=None, what: str | None = None,
                         force_check: bool = False, defer_check: bool = False):
    """An asynchronous :func:`all_gather_packed` whose ``(world_size, span)`` result is handed to
    ``deliver(lo, hi, rows)`` -- ``rows`` (world_size, hi - lo) holding columns ``[lo, hi)``, readable during the call
    only -- in column order, at ``wait()``: through a shared ring (ranks of one host, CPU) chunk by chunk straight
    from shared memory (shm_collectives.delivered_all_gather), with no packed buffer between; elsewhere from a
    pooled packed buffer, all columns at once. ``force_check``, ``defer_check``: as for
    :func:`all_gather_packed`."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    spec = _Spec((world, shard.numel()), shard.dtype, shard.device)
    if world == 1:
        deliver(0, shard.numel(), shard.view(1, -1))
        return DoneWork()
    ring = shm_ring.existing(group) if shard.device.type == "cpu" else None
    if ring is not None:
        return _issue("all_gather", delivered_all_gather, spec, what, group, True, ring, what, shard, deliver,
                      spec.shape, shard.dtype, force_check=force_check, defer_check=defer_check)
    return _issue("all_gather", _gather_then_deliver, spec, what, group, True, shard, deliver, spec,
                  force_check=force_check, defer_check=defer_check)


def _gather_then_deliver(shard: torch.Tensor, deliver, spec: _Spec, group=None, async_op: bool = True) -> "_RowWorks":
    packed = buffer_pool.take(spec.shape, spec.dtype, spec.device)
    work = _all_gather_any(packed, shard, group)

    def then() -> None:
        deliver(0, spec.shape[1], packed)
        buffer_pool.give(packed)

    return _RowWorks([work], then)


# ---- gloo: the packed collectives as one collective per row ---------------------------------------------------------
#
# gloo's all_gather_into_tensor gathers into a flat buffer of its own and copies it into the output; its
# reduce_scatter_tensor clones the whole input first. Those buffers are fresh allocations on gloo's threads for every
# collective -- with hf_zero's fixed mmap threshold (host_memory.py), fresh mmaps faulted in page by page. Measured
# on the 2-core machine, 2 ranks, an 11.6 MB packed buffer (one layer of the 32M Llama), per collective:
#
#     all_gather_into_tensor   2834 faults   9.6-11.0 ms CPU   22-35 ms wall
#     one broadcast per row       0 faults   3.2-4.5 ms CPU     9-11 ms wall
#     reduce_scatter_tensor    3306 faults  12.7-16.5 ms CPU   31-33 ms wall
#     one reduce per row       1026 faults   8.6 ms CPU           11 ms wall
#
# The same bytes cross the wire (each rank sends its row to / receives every other row from each peer); the rows go
# in place. (An all-reduce would also avoid the copies, but moves twice the bytes of a reduce-scatter.)


def _by_rows(packed: torch.Tensor, group) -> bool:
    return packed.device.type == "cpu" and backend_for("cpu", group) == "gloo"


class _RowWorks:
    """Several collectives in flight as one handle; ``then`` runs once, after the last has finished."""

    def __init__(self, works, then=None) -> None:
        self.works, self.then = works, then

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout=timeout)
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _row_broadcasts(packed: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = True) -> _RowWorks:
    rank = dist.get_rank(group)
    if shard.data_ptr() != packed[rank].data_ptr():
        packed[rank].copy_(shard)
    works = [dist.broadcast(packed[r], src=_global(group, r), group=group, async_op=True)
             for r in range(packed.shape[0])]
    return _RowWorks(works)


def _row_reduces(out: torch.Tensor, packed: torch.Tensor, group=None, async_op: bool = True) -> _RowWorks:
    rank = dist.get_rank(group)
    works = [dist.reduce(packed[r], dst=_global(group, r), op=dist.ReduceOp.SUM, group=group, async_op=True)
             for r in range(packed.shape[0])]
    row = packed[rank]
    return _RowWorks(works, None if out.data_ptr() == row.data_ptr() else (lambda: out.copy_(row)))


# ---- gloo with CUDA tensors: through host memory -----------------------------------------------------------------
#
# A script may put several ranks on one GPU over gloo (NCCL refuses two ranks on one device): gloo has no reduce
# for CUDA tensors, so both bulk collectives copy the packed buffer to the host, run the row collectives above
# there, and copy the result back when waited on. A test and debugging set-up, not a fast path.


def _gloo_on_gpu(packed: torch.Tensor, group) -> bool:
    # the backend that serves CUDA tensors: hf_zero's NCCL groups also have gloo, for CPU tensors (NCCL_WITH_GLOO)
    return packed.device.type == "cuda" and backend_for("cuda", group) == "gloo"


def _host_all_gather(packed: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = True) -> _RowWorks:
    host = packed.cpu()
    rank = dist.get_rank(group)
    host[rank].copy_(shard)
    return _RowWorks(_row_broadcasts(host, host[rank], group).works, then=lambda: packed.copy_(host))


def _host_reduce_scatter(out: torch.Tensor, packed: torch.Tensor, group=None, async_op: bool = True) -> _RowWorks:
    host = packed.cpu()
    row = host[dist.get_rank(group)]
    return _RowWorks(_row_reduces(row, host, group).works, then=lambda: out.copy_(row))


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def all_reduce_(tensor: torch.Tensor, group=None, async_op: bool = False, op=dist.ReduceOp.SUM,
                what: str | None = None):
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return DoneWork()
    return _issue("all_reduce", dist.all_reduce, tensor, what, group, async_op, tensor, op=op)


def all_to_all_single_(out: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False,
                       what: str | None = None):
    """``out`` <- the equal-split all-to-all of ``tensor`` (dim 0 cut in ``world_size`` blocks: block ``j`` goes to
    rank ``j``, block ``i`` of ``out`` came from rank ``i``), bounded and checked like every hf_zero collective. gloo
    implements it for CPU tensors (MoE expert parallelism's token exchange)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        out.copy_(tensor)
        return DoneWork()
    return _issue("all_to_all", dist.all_to_all_single, tensor, what, group, async_op, out, tensor,
                  log_name="all_to_all_single")


def barrier(group=None, what: str = "a barrier", log_name: str = "barrier") -> None:
    """``dist.barrier``, bounded by comms_timeout_s and checked like every hf_zero collective (the comms logger
    files it under ``log_name``)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    # an all-reduce of one element is a barrier, and goes through the same check and bound
    flag = torch.zeros(1, device=bookkeeping_device(group))
    _issue("all_reduce", dist.all_reduce, flag, what, group, False, flag, log_name=log_name)
