"""Gradient reduce-scatter in buckets: full gradients in, each rank's summed shard out.

A gradient arriving for parameter ``p`` (full shape, compute dtype) takes columns ``[off, off + shard_numel)`` of
the current bucket, a ``(world_size, used)`` packed buffer (zero/layout.py) that exists only as the list of its
gradients: the reduce-scatter fills it -- each gradient multiplied by ``grad_scale`` on the way -- where the
collective wants it (straight into the shared ring on one host, a pooled buffer elsewhere;
comm/collectives.reduce_scatter_filled), and hands rank ``r`` the sums of row ``r``: its shard of every parameter in
the bucket, which go straight into the parameter's grad storage. The first shard after the optimizer cleared the
storage is written there (ShardedParam.grad_zeroed); later ones are *added* (gradient accumulation across
micro-steps is this addition). When the next gradient does not fit, the bucket is sent; with ``overlap_comm`` one
bucket stays in flight while the next one fills. A bucket holds at most ``reduce_bucket_size`` elements and
:data:`~hf_zero.comm.buckets.BUCKET_CAP_BYTES` (unless one gradient alone is larger), so reductions start early in
backward. Holding the gradients instead of a packed copy costs the same bytes and saves the copy.
"""

from __future__ import annotations

import bisect

import torch

from hf_zero.comm import buffer_pool, reduce_scatter_filled
from hf_zero.profiling.timers import NO_TIMERS
from hf_zero.zero.layout import capped_bucket_numel

from .divergence import wait_or_diagnose
from .param import ShardedParam

__all__ = ["Stage3GradReducer"]


class Stage3GradReducer:
    """ZeRO-3's reducer: gradients join a bucket as they arrive (from the runtime's backward hooks), bucket after
    bucket; stages 0-2 use :class:`hf_zero.zero.grad_reducer.GroupGradReducer`, whose buckets are fixed in
    advance over each group's parameters."""

    def __init__(self, *, group, rank: int, world_size: int, bucket_numel: int, grad_scale: float,
                 overlap_comm: bool, timeout_s_fn) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.bucket_numel = max(int(bucket_numel), 1)
        self.grad_scale = grad_scale
        self.overlap_comm = overlap_comm
        self._timeout_s = timeout_s_fn
        self._entries: list[_Entry] = []  # the current bucket's gradients, in column order
        self._used = 0
        self._capacity = 0
        self._inflight: list[tuple[object, list[_Entry]]] = []
        self.reduced_numel = 0  # statistics: elements reduce-scattered (per rank row)
        self.timers = NO_TIMERS  # the engine's: time blocked in reduce-scatters counts as "communication"

    def add(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        if self.world_size == 1 and (sp.grad_storage is None or sp.grad_storage.device == grad.device):
            self.accumulate_alone([(sp, grad)])
            return
        width = sp.shard_numel
        flat = grad.detach().reshape(-1)
        if self._entries and (self._used + width > self._capacity or self._entries[0].grad.dtype != flat.dtype or
                              self._entries[0].grad.device != flat.device):
            self.flush()
        if not self._entries:
            self._capacity = max(capped_bucket_numel(self.bucket_numel, flat.element_size()) // self.world_size,
                                 width)
        self._entries.append(_Entry(sp, flat, self._used))
        self._used += width

    def accumulate_alone(self, items: list[tuple[ShardedParam, torch.Tensor]]) -> None:
        """A world of one: each gradient is its own reduced shard. They go into their grad storages in one batch --
        copied where the storage holds known zeros, added otherwise, scaled and cast on the way -- instead of
        packing a bucket and reduce-scattering it with nobody (one gradient from the hooks; all of them at once
        when ZeRO-3 keeps parameters whole, Stage3Runtime.whole)."""
        copies, adds = ([], []), ([], [])
        for sp, grad in items:
            if sp.grad_storage is None:
                sp.grad_storage = torch.zeros(sp.shard_numel, dtype=torch.float32, device=grad.device)
            dst, src = copies if sp.grad_zeroed else adds
            dst.append(sp.grad_storage)
            src.append(grad.detach().reshape(-1))
            sp.grad_zeroed = False
            self.reduced_numel += sp.shard_numel
        with torch.no_grad():
            if copies[0]:
                torch._foreach_copy_(*copies)
                if self.grad_scale != 1.0:
                    torch._foreach_mul_(copies[0], self.grad_scale)
            if adds[0]:
                torch._foreach_add_(*adds, alpha=self.grad_scale)

    def flush(self) -> None:
        """Reduce-scatter the current bucket (asynchronously with overlap_comm)."""
        if not self._entries:
            return
        entries, used = self._entries, self._used
        self._entries, self._used = [], 0
        dtype, device = entries[0].grad.dtype, entries[0].grad.device  # not the tensor: released once packed
        names = ", ".join(e.sp.name for e in entries[:3]) + (" ..." if len(entries) > 3 else "")
        work = reduce_scatter_filled(lambda dst, lo: _fill(entries, dst, lo, self.grad_scale),
                                     (self.world_size, used), dtype, device,
                                     deliver=lambda lo, hi, sum_into: _deliver(entries, lo, hi, sum_into, dtype, device),
                                     filled=lambda: _release(entries), group=self.group,
                                     what=f"the gradient reduce-scatter of [{names}]", defer_check=True)
        self._inflight.append((work, entries))
        self.reduced_numel += used
        self._drain(keep=1 if self.overlap_comm else 0)

    def finish(self) -> None:
        self.flush()
        self._drain(keep=0)

    def _drain(self, keep: int) -> None:
        while len(self._inflight) > keep:
            work, entries = self._inflight.pop(0)
            with self.timers.phase("communication"):
                wait_or_diagnose(work, self._timeout_s(), getattr(work, "what", "a gradient reduce-scatter"), None,
                                 self.group)
            _release(entries)  # packed by now (filled), whatever the path: nothing left to give normally


class _Entry:
    """One gradient of a bucket: columns ``[off, off + sp.shard_numel)``. ``write``: whether its sums are written
    into the grad storage (known zeros) or added, decided when its first columns are delivered."""

    __slots__ = ("sp", "grad", "off", "write")

    def __init__(self, sp: ShardedParam, grad: torch.Tensor, off: int) -> None:
        self.sp, self.grad, self.off, self.write = sp, grad, off, None


def _release(entries: list[_Entry]) -> None:
    """The bucket's gradients are packed (reduce_scatter_filled's ``filled``): drop them; on the CPU their bytes can
    serve the next gather (comm/buffer_pool.py). Off the ring this runs when the collective is issued, so a bucket
    in flight holds its packed copy only, not its gradients too."""
    for e in entries:
        grad, e.grad = e.grad, None
        buffer_pool.give_if_unshared(grad)
        del grad


def _overlapping(entries: list[_Entry], lo: int, hi: int):
    """The entries whose columns meet ``[lo, hi)``, with the meeting columns ``[a, b)``."""
    i = bisect.bisect_right(entries, lo, key=lambda e: e.off) - 1
    for e in entries[max(i, 0):]:
        if e.off >= hi:
            break
        a, b = max(lo, e.off), min(hi, e.off + e.sp.shard_numel)
        if a < b:
            yield e, a, b


def _fill(entries: list[_Entry], dst: torch.Tensor, lo: int, scale: float) -> None:
    """Columns ``[lo, lo + dst.shape[1])`` of the bucket's packed buffer into ``dst``."""
    for e, a, b in _overlapping(entries, lo, lo + dst.shape[1]):
        e.sp.layout.pack_columns([e.grad], 0, dst[:, a - lo:b - lo], a - e.off, scale=scale)


def _deliver(entries: list[_Entry], lo: int, hi: int, sum_into, dtype: torch.dtype, device: torch.device) -> None:
    """The sums of columns ``[lo, hi)`` into the grad storages: written where the storage holds known zeros, added
    otherwise."""
    host = None  # offload_param: the shards' gradients live in host memory; one copy of the chunk there
    for e, a, b in _overlapping(entries, lo, hi):
        sp = e.sp
        if sp.grad_storage is None:
            sp.grad_storage = torch.zeros(sp.shard_numel, dtype=torch.float32, device=device)
        if e.write is None:
            e.write, sp.grad_zeroed = sp.grad_zeroed, False
        dst = sp.grad_storage[a - e.off:b - e.off]
        if dst.device == device:
            sum_into(dst, a, b, add=not e.write)
            continue
        if host is None:
            host = torch.empty(hi - lo, dtype=dtype, device=device)
            sum_into(host, lo, hi)
            host = host.to(dst.device)
        if e.write:
            dst.copy_(host[a - lo:b - lo])
        else:
            dst.add_(host[a - lo:b - lo])
