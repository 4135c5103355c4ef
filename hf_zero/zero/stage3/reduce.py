"""Gradient reduce-scatter in packed buckets: full gradients in, each rank's summed shard out.

A gradient arriving for parameter ``p`` (full shape, compute dtype) is packed -- already multiplied by
``grad_scale`` -- into columns ``[off, off + shard_numel)`` of the current bucket ``(world_size, capacity)``.
When the next gradient does not fit, the bucket is reduce-scattered: rank ``r`` receives ``(used,)``, the sum over
ranks of row ``r``, i.e. its shard of every parameter in the bucket, and *adds* each shard into the parameter's
grad storage (gradient accumulation across micro-steps is this addition; the first shard after the optimizer
cleared the storage is copied instead, ShardedParam.grad_zeroed). With ``overlap_comm`` one bucket stays
in flight while the next one fills. A bucket holds at most ``reduce_bucket_size`` elements and
:data:`~hf_zero.comm.buckets.BUCKET_CAP_BYTES` (unless one gradient alone is larger), so reductions start early in
backward and a partly filled last bucket is compacted from little memory.
"""

from __future__ import annotations

import torch

from hf_zero.comm import buffer_pool, reduce_scatter_packed
from hf_zero.profiling.timers import NO_TIMERS
from hf_zero.zero.layout import capped_bucket_numel

from .divergence import wait_or_diagnose
from .param import ShardedParam

__all__ = ["Stage3GradReducer"]


class Stage3GradReducer:
    """ZeRO-3's reducer: gradients are packed as they arrive (from the runtime's backward hooks), bucket after
    bucket; stages 0-2 use :class:`hf_zero.zero.grad_reducer.GroupGradReducer`, whose buckets are fixed in
    advance over each group's parameters."""

    def __init__(self, *, group, rank: int, world_size: int, bucket_numel: int, grad_scale: float,
                 overlap_comm: bool, timeout_s_fn) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.bucket_numel = max(int(bucket_numel), 1)
        self.grad_scale = grad_scale
        self.overlap_comm = overlap_comm
        self._timeout_s = timeout_s_fn
        self._bucket: torch.Tensor | None = None  # (world_size, capacity)
        self._used = 0
        self._entries: list[tuple[ShardedParam, int]] = []  # (param, column offset)
        self._inflight: list[tuple[object, torch.Tensor, list[tuple[ShardedParam, int]], torch.Tensor]] = []
        # Gradients arrive in the same order every backward, so each bucket is sized to what the same bucket of
        # the previous backward held: it is sent full, with no compacting copy into a smaller buffer. A bucket that
        # ends up only partly filled (the order changed) is compacted as before.
        self._widths: list[int] = []       # filled columns of each bucket of the last complete backward
        self._next_widths: list[int] = []  # ... of this one so far
        self.reduced_numel = 0  # statistics: elements reduce-scattered (per rank row)
        self.timers = NO_TIMERS  # the engine's: time blocked in reduce-scatters counts as "communication"

    def add(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        if self.world_size == 1 and (sp.grad_storage is None or sp.grad_storage.device == grad.device):
            self.accumulate_alone([(sp, grad)])
            return
        width = sp.shard_numel
        if self._bucket is not None and (self._used + width > self._bucket.shape[1] or
                                         self._bucket.dtype != grad.dtype):
            self.flush()
        if self._bucket is None:
            capacity = max(capped_bucket_numel(self.bucket_numel, grad.element_size()) // self.world_size, width)
            index = len(self._next_widths)
            if index < len(self._widths) and width <= self._widths[index] <= capacity:
                capacity = self._widths[index]
            self._bucket = buffer_pool.take((self.world_size, capacity), grad.dtype, grad.device)
            self._used = 0
        block = self._bucket[:, self._used:self._used + width]
        sp.layout.pack([grad.detach().reshape(-1)], 0, block, scale=self.grad_scale)
        self._entries.append((sp, self._used))
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
        if self._bucket is None:
            return
        bucket = self._bucket
        self._next_widths.append(self._used)
        if self._used == bucket.shape[1]:
            packed = bucket
        else:  # compact the filled columns into a (world_size, used) buffer, and give the bucket back
            packed = buffer_pool.take((self.world_size, self._used), bucket.dtype, bucket.device)
            packed.copy_(bucket[:, :self._used])
            buffer_pool.give(bucket)
        out = buffer_pool.take(self._used, packed.dtype, packed.device)
        names = ", ".join(sp.name for sp, _ in self._entries[:3]) + (" ..." if len(self._entries) > 3 else "")
        work = reduce_scatter_packed(out, packed, group=self.group, async_op=True, defer_check=True,
                                     what=f"the gradient reduce-scatter of [{names}]")
        self._inflight.append((work, out, self._entries, packed))
        self.reduced_numel += self._used
        self._bucket, self._entries, self._used = None, [], 0
        self._drain(keep=1 if self.overlap_comm else 0)

    def finish(self) -> None:
        self.flush()
        self._drain(keep=0)
        self._widths, self._next_widths = self._next_widths, []

    def _drain(self, keep: int) -> None:
        while len(self._inflight) > keep:
            work, out, entries, _packed = self._inflight.pop(0)
            with self.timers.phase("communication"):
                wait_or_diagnose(work, self._timeout_s(), getattr(work, "what", "a gradient reduce-scatter"), None,
                                 self.group)
            host = None  # offload_param: the shards' gradients live in host memory; one copy of the bucket there
            for sp, off in entries:
                if sp.grad_storage is None:
                    sp.grad_storage = torch.zeros(sp.shard_numel, dtype=torch.float32, device=out.device)
                src = out
                if sp.grad_storage.device != out.device:
                    host = out.to(sp.grad_storage.device) if host is None else host
                    src = host
                if sp.grad_zeroed:  # known zeros (pages possibly handed back): write, don't read them first
                    sp.grad_storage.copy_(src[off:off + sp.shard_numel])
                    sp.grad_zeroed = False
                else:
                    sp.grad_storage.add_(src[off:off + sp.shard_numel])
            buffer_pool.give(out)
            buffer_pool.give(_packed)
