"""Gradient reduction for ZeRO stages 0, 1 and 2, bucketed and overlapped with backward.

Each trainable parameter gets a post-accumulate-grad hook. On a *reducing* backward (every micro-step at stage 2,
only the accumulation boundary at stages 0/1) the hook marks the parameter ready; a bucket whose parameters are
all ready is launched: its gradients leave the parameters (``param.grad`` is None from then on) and are
reduce-scattered (stages 1/2) or all-reduced (stage 0, a world of one in the layout) into the group's gradient
shard, pre-divided by the world size, asynchronously when ``overlap_comm`` is on. An all-reduce packs the bucket
into a ``(world_size, span)`` buffer; a reduce-scatter packs it where it sends it (comm/collectives.
reduce_scatter_filled: through the shared ring of ranks on one host, straight into shared memory when it runs),
holding the gradients until then instead of a packed copy of the same bytes.

Buffers, sized by need: a bucket holds at most ``reduce_bucket_size`` elements and
:data:`~hf_zero.comm.buckets.BUCKET_CAP_BYTES`, so backward overlaps the reductions and at most
``max_in_flight + 1`` buckets exist at once. When the group's shard holds nothing yet in this accumulation
window (``ShardedGroup.grad_fresh``), the collective writes straight into the shard: no result buffer, no add
(stage 0 packs into the shard itself and all-reduces it in place).

MoE expert parameters under expert parallelism (``ShardedGroup.expert``) are groups of their own, reduced over
their expert-data-parallel group (the ranks holding the same experts) and cut over it at stages 1/2, but divided by
the whole data-parallel world like every gradient: an expert's gradient already sums, through the token
all-to-all's backward, what every rank of its expert-parallel group routed to it (DeepSpeed divides the same way).

Why buckets are launched strictly in a fixed order: every rank must issue the same collectives in the same order.
Readiness order can differ between ranks (unused parameters, data-dependent branches), so bucket k is launched
only after buckets 0..k-1; whatever is not ready when backward ends is flushed in that same order, with zeros for
parameters that got no gradient. A gradient that arrives after its bucket left (a parameter used in two reentrant
checkpoint segments) is caught at the end of backward and reduced in one extra bucket; ranks agree on whether that
is needed with one tiny all-reduce.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from hf_zero.comm import all_reduce_, buffer_pool, faults, reduce_scatter_filled, shm_ring
from hf_zero.comm.process_group import bookkeeping_device
from hf_zero.profiling.timers import NO_TIMERS
from hf_zero.zero.layout import capped_bucket_numel
from hf_zero.zero.local import local_grad, local_tensor
from hf_zero.zero.sharded_group import ShardedGroup, bucket_ranges, comm_group

__all__ = ["GroupGradReducer", "ReduceMode"]


class ReduceMode(enum.Enum):
    ALL_REDUCE = "all_reduce"          # stage 0: every rank keeps the full averaged gradient
    REDUCE_SCATTER = "reduce_scatter"  # stages 1/2: every rank keeps its shards


@dataclass
class _Bucket:
    group: ShardedGroup
    start: int          # parameter index range [start, stop) inside the group
    stop: int
    ready: set = field(default_factory=set)
    launched: bool = False


@dataclass
class _InFlight:
    work: object
    out: torch.Tensor | None  # (span,) result of the collective (None: it is delivered into the shard itself)
    bucket: _Bucket
    accumulate: bool    # add ``out`` into the shard (False: the collective wrote into the shard itself)
    packed: torch.Tensor | None = None  # the pooled input buffer, given back once the collective is done


class GroupGradReducer:
    """Owns the gradient hooks of one engine. ``begin(reducing)`` before backward, ``finish()`` after it."""

    def __init__(self, groups: list[ShardedGroup], *, mode: ReduceMode, bucket_numel: int, overlap: bool,
                 process_group=None, max_in_flight: int = 2, guard: Callable[[str], None] | None = None,
                 average: bool = True):
        """``guard(param_name)`` runs as each gradient arrives, before anything else (the engine refuses
        gradients of backward passes it did not see there). ``average``: the data-parallel mean of the gradients
        (False: their sum, ``gradient_allreduce_op: sum``)."""
        self.average = average
        self.groups = groups
        self.guard = guard
        # the names of the parameters a gradient arrived for, since the caller last cleared it; None: not kept
        # (zero_optimization.ignore_unused_parameters false: the engine checks it at each step)
        self.arrived: set[str] | None = None
        self.mode = mode
        self.overlap = overlap
        self.process_group = process_group
        self.max_in_flight = max_in_flight
        # the dense groups' shard world (expert groups have their own: ShardedGroup.world_size)
        self.world_size = next((g.world_size for g in groups if getattr(g, "expert", None) is None), 1)
        # stage 0 averages over the real world, though its layout is a world of one
        self.data_parallel_size = (torch.distributed.get_world_size(process_group)
                                   if torch.distributed.is_initialized() else 1)
        if self.world_size > 1 and groups[0].grad.device.type == "cpu":
            # ranks of one host: the reduce-scatters and the publishing all-gathers go through shared memory
            # (comm/shm_ring.py); built here, where every rank comes (a collective)
            shm_ring.ring_for(process_group, shm_ring.BOUNCE_RING_BYTES)
        self.buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        # buckets run in reverse parameter order: the order backward produces gradients in most models
        for g in groups:
            capped = capped_bucket_numel(bucket_numel, g.grad.element_size())
            for start, stop in bucket_ranges(g.layout.shard_numels, g.world_size, capped):
                self.buckets.append(_Bucket(g, start, stop))
        self.buckets.reverse()
        for b in self.buckets:
            for i in range(b.start, b.stop):
                self._where[b.group.params[i]] = (b, i)
        # Alone (a data-parallel world of one) there is nothing to overlap with backward: no per-parameter hook
        # (each is a call into Python from autograd's thread), the gradients are taken in one batch by finish()
        self.alone = self.data_parallel_size == 1 and all(g.world_size == 1 for g in groups)
        self._handles = ([] if self.alone else
                         [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._where])
        self._reducing = False
        self._next = 0  # index of the next bucket to launch
        self._in_flight: list[_InFlight] = []
        self._direct: set[int] = set()  # id() of the groups whose shard the collectives write in place
        self._exposed: list[nn.Parameter] = []  # stage 0: parameters whose .grad views the reduced gradient
        self.timers = NO_TIMERS  # the engine's: time blocked in collectives counts as "communication"

    # ---- public -----------------------------------------------------------------------------------------------
    def begin(self, reducing: bool) -> None:
        """Called before backward. ``reducing=False`` lets gradients accumulate in ``param.grad`` untouched."""
        self.hide_grads()
        self._reducing = reducing
        self._direct = set()
        if reducing:
            for g in self.groups:
                # every element of the shard is written by exactly one bucket of this pass. A shard not allocated
                # yet is allocated by the first of them (_shard_of), not here: at the start of backward the
                # activations are at their peak, and the shard (4 bytes per parameter in fp32) would add to it
                if g.grad_fresh or not _allocated(g):
                    self._direct.add(id(g))
                    g.grad_fresh = False
        self._next = 0
        for b in self.buckets:
            b.ready.clear()
            b.launched = False
        if reducing and self.data_parallel_size > 1:
            self._check_pass()

    @property
    def reducing(self) -> bool:
        """Whether the backward pass now running (between begin and finish) reduces its gradients."""
        return self._reducing

    def _check_pass(self) -> None:
        """One divergence header for the whole pass (comm/faults.check_run) instead of one per bucket: the buckets
        are launched in a fixed order with fixed sizes, then the late-gradient flag is all-reduced, and no other
        checked collective runs on this group in a stage 0-2 backward -- each header is a wait on every rank, in
        the middle of backward. Ranks about to run different passes (one reduces, one does not) fail here."""
        runs: dict[int, tuple[object, list, list[_Bucket]]] = {}  # id(process group) -> (group, items, buckets)
        for b in self.buckets:
            lo, hi = b.group.layout.span(b.start, b.stop)
            pg = comm_group(b.group, self.process_group)
            _, items, buckets = runs.setdefault(id(pg), (pg, [], []))
            buckets.append(b)
            if self.mode is ReduceMode.REDUCE_SCATTER:
                items.append(("reduce_scatter", b.group.world_size * (hi - lo), b.group.grad.dtype))
            else:
                items.append(("all_reduce", hi - lo, b.group.grad.dtype))
        _, items, _ = runs.setdefault(id(self.process_group), (self.process_group, [], []))
        items.append(("all_reduce", 1, torch.float32))  # _reduce_late_gradients' flag
        # one run per process group (expert groups reduce over their own); each is issued in this fixed order
        for pg, items, buckets in runs.values():
            first = buckets[0] if buckets else None
            # deferred: verified when the first bucket leaves, so the header's round trip overlaps backward compute
            faults.check_run(items, f"the gradient reductions of a backward ({len(buckets)} buckets"
                                    + (f", from [{first.group.names[first.start]} ...])" if first else ")"),
                             pg, defer=True)

    def finish(self) -> None:
        """Called after backward: flush the buckets not yet launched, wait for all, catch late gradients."""
        if not self._reducing:
            return
        if self.alone:
            self._take_alone()
            self._reducing = False
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        self._drain(0)
        self._reduce_late_gradients()
        self._reducing = False

    def expose_grads(self) -> None:
        """Stage 0, after a pass that reduced: each parameter's ``.grad`` becomes its slice of the group's reduced
        gradient (a view: no copy, and an edit -- a script's own clipping -- is what the step uses), as DeepSpeed
        leaves the all-reduced gradients in ``p.grad`` without ZeRO. Only where the slice can be the gradient: a
        plain (not tensor-parallel) parameter of the gradient's dtype. :meth:`hide_grads` undoes it."""
        if self.mode is not ReduceMode.ALL_REDUCE:
            return
        for g in self.groups:
            if not _allocated(g):
                continue
            for i, p in enumerate(g.params):
                if p.grad is None and local_tensor(p) is p and p.dtype == g.grad.dtype:
                    lo, hi = g.layout.offsets[i], g.layout.offsets[i + 1]
                    p.grad = g.grad[lo:hi].view_as(p)
                    self._exposed.append(p)

    def hide_grads(self) -> None:
        """Drop the views :meth:`expose_grads` set (before the next backward, which must accumulate into fresh
        gradients, and after the step, which may free the reduced buffer)."""
        for p in self._exposed:
            p.grad = None
        self._exposed.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- hooks ------------------------------------------------------------------------------------------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket, index = self._where[param]
        if self.guard is not None:
            self.guard(bucket.group.names[index])
        if self.arrived is not None:
            self.arrived.add(bucket.group.names[index])
        if not self._reducing:
            return
        if bucket.launched:
            return  # a late gradient: left in param.grad, picked up by _reduce_late_gradients
        bucket.ready.add(index)
        while self._next < len(self.buckets):
            nxt = self.buckets[self._next]
            if len(nxt.ready) < nxt.stop - nxt.start:
                break
            self._launch(nxt)

    # ---- internals --------------------------------------------------------------------------------------------
    def _launch(self, bucket: _Bucket) -> None:
        g = bucket.group
        _shard_of(g)
        lo, hi = g.layout.span(bucket.start, bucket.stop)
        direct = id(g) in self._direct
        flats = []
        for i in range(bucket.start, bucket.stop):
            p = g.params[i]
            flats.append(local_grad(p).reshape(-1) if p.grad is not None else
                         torch.zeros(local_tensor(p).numel(), dtype=g.grad.dtype, device=g.grad.device))
            p.grad = None  # the full gradient is no longer the parameter's: this is where stage 2 saves memory
        scale = 1.0 / self.data_parallel_size if self.data_parallel_size > 1 and self.average else None
        bucket.launched = True
        self._next += 1
        what = f"the gradient reduction of [{g.names[bucket.start]}{' ...' if bucket.stop - bucket.start > 1 else ''}]"
        if self.mode is ReduceMode.REDUCE_SCATTER:
            # The packed bucket is never built whole here: the collective packs the gradients where it sends them
            # (through a shared ring: straight into shared memory) and writes or adds the sums into the shard.
            def fill(dst: torch.Tensor, col: int) -> None:
                g.layout.pack_columns(flats, bucket.start, dst, col, scale=scale)

            shard = g.grad[lo:hi]
            where = dict(out=shard) if direct else dict(
                deliver=lambda a, b, sum_into: sum_into(shard[a:b], a, b, add=True))
            # The collective holds the gradients (through fill) until it has packed them: at issue off the ring
            # (NCCL, gloo by rows), then they are freed while it is in flight; at wait() through the ring.
            with self.timers.phase("communication"):
                work = reduce_scatter_filled(fill, (g.world_size, hi - lo), g.grad.dtype, g.grad.device,
                                             filled=flats.clear, group=comm_group(g, self.process_group),
                                             what=what, **where)
            del fill
            self._in_flight.append(_InFlight(work, None, bucket, accumulate=False))
        else:
            if direct:
                packed = g.grad[lo:hi].view(1, hi - lo)  # a world of one in the layout: the shard is the bucket
            else:
                packed = buffer_pool.take((g.world_size, hi - lo), g.grad.dtype, g.grad.device)
            g.layout.pack(flats, bucket.start, packed, scale=scale)
            del flats
            out = packed[0]
            with self.timers.phase("communication"):
                work = all_reduce_(out, group=comm_group(g, self.process_group), async_op=self.overlap, what=what)
            self._in_flight.append(_InFlight(work, out, bucket, accumulate=not direct,
                                             packed=None if direct else packed))
        self._drain(self.max_in_flight if self.overlap else 0)

    def _drain(self, keep: int) -> None:
        """Complete the oldest collectives until at most ``keep`` are in flight."""
        while len(self._in_flight) > keep:
            item = self._in_flight.pop(0)
            with self.timers.phase("communication"):
                item.work.wait()
            if item.accumulate:
                g = item.bucket.group
                lo, hi = g.layout.span(item.bucket.start, item.bucket.stop)
                g.grad[lo:hi].add_(item.out)
            buffer_pool.give(item.packed)

    def _take_alone(self) -> None:
        """A world of one: every parameter's ``.grad`` into its slot of the group's gradient shard, in one batch
        per group (a copy into a shard nothing was reduced into yet this window, an add otherwise); ``.grad`` is
        cleared, as the bucket path does."""
        with torch.no_grad():
            for g in self.groups:
                _shard_of(g)  # allocated now, after backward freed the activations
                dsts, srcs = [], []
                for i, p in enumerate(g.params):
                    lo, hi = g.layout.offsets[i], g.layout.offsets[i + 1]
                    if p.grad is None:
                        if id(g) in self._direct:  # the shard's previous values are not read: no gradient is 0
                            g.grad[lo:hi].zero_()
                        continue
                    dsts.append(g.grad[lo:hi])
                    srcs.append(local_grad(p).reshape(-1))
                    p.grad = None
                if not dsts:
                    continue
                if id(g) in self._direct:
                    torch._foreach_copy_(dsts, srcs)
                else:
                    torch._foreach_add_(dsts, srcs)

    def _reduce_late_gradients(self) -> None:
        late = [(b, i) for b in self.buckets for i in range(b.start, b.stop) if b.group.params[i].grad is not None]
        if self.data_parallel_size > 1:
            # every rank must know whether any rank has one (the extra bucket pass is collective)
            flag = torch.tensor([float(len(late))], device=bookkeeping_device(self.process_group))
            all_reduce_(flag, group=self.process_group)
            any_late = flag.item() != 0  # (a host sync on a plain NCCL group; the CPU beside hf_zero's own)
        else:
            any_late = bool(late)  # alone: no collective, and no sync with a GPU
        if not any_late:
            return
        # every rank reduces every bucket once more; only gradients that arrived late are non-zero
        self._reducing = True
        self._direct = set()  # the shard holds this pass's first reduction: add to it
        for b in self.buckets:
            b.launched = False
        self._next = 0
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        self._drain(0)


def _allocated(g: ShardedGroup) -> bool:
    return g.grad.numel() == g.layout.shard_numel


def _shard_of(g: ShardedGroup) -> None:
    """The group's gradient shard, allocated on first use in a reducing pass. Whether this pass writes or adds into
    it was decided by begin(); allocating it does not make it fresh again."""
    if not _allocated(g):
        g.ensure_grad()
        g.grad_fresh = False
