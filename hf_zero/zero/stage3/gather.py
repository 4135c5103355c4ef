"""Packed all-gathers of ShardedParams, one :class:`Gatherer` per process group.

A gather of parameters ``p0..pk`` is one collective: each rank writes its shards back to back (the flat shard of
zero/layout.py) plus a divergence trailer into its own row of the packed ``(world_size, span + TRAILER_NUMEL)``
buffer, receives the other rows in place, and unpacks the buffer into one flat ``(numel,)`` buffer per parameter.
Packed and flat buffers come from comm/buffer_pool.py (a fresh one would be a fresh mmap on CPU, faulted in page by
page every step); a parameter parked in forward is refilled in its own storage (ShardedParam.take_parked).

NOTE: the unpack is a copy (the trailer, and rows that interleave parameters, keep any parameter from being
contiguous in the packed buffer), so a gather peaks at twice its parameters' bytes until the packed buffer is
dropped, right after -- except where the packed buffer would be too large for the group's shared ring (ranks of one
host): those gathers go through the ring chunk by chunk, unpacked from each chunk straight into the parameters.
The Gatherer also counts the bytes of full parameters alive at once (``live_bytes`` / ``peak_live_bytes``) -- the
number memory limits and tests look at.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hf_zero.comm import (all_gather_delivered, all_gather_packed, buffer_pool, context, faults, give_packed, shm_ring,
                          take_gather_buffer)
from hf_zero.comm.device import accelerator_device
from hf_zero.offload.swapper import wait_all
from hf_zero.profiling.timers import NO_TIMERS
from hf_zero.zero.layout import ShardLayout

from .divergence import TRAILER_NUMEL, check_trailers, params_key, wait_or_diagnose, write_trailer
from .param import GATHERED_FIT, ParamState, ShardedParam

__all__ = ["Gatherer", "PendingGather", "gatherer_for", "DEFAULT_DIVERGENCE_TIMEOUT_S"]

DEFAULT_DIVERGENCE_TIMEOUT_S = 300.0


class PendingGather:
    """One all-gather in flight for ``sps``; :meth:`wait` makes them AVAILABLE. Safe to call more than once.

    ``packed`` is the whole ``(world_size, span + TRAILER_NUMEL)`` result, unpacked after the wait; or None for a
    gather too large for the group's shared ring, which delivers its rows chunk by chunk during the wait
    (:meth:`deliver`) straight into the parameters' buffers, from this rank's ``send`` row."""

    def __init__(self, gatherer: "Gatherer", sps: list[ShardedParam], layout: ShardLayout,
                 packed: torch.Tensor | None, work, key: int, seq: int, label: str,
                 send: torch.Tensor | None = None, headed: bool = False) -> None:
        self.gatherer, self.sps, self.layout = gatherer, sps, layout
        self.packed = packed  # (world_size, span + TRAILER_NUMEL)
        self.send = send  # this rank's row as sent, when it is not a row of ``packed``
        self.work, self.key, self.seq, self.label = work, key, seq, label
        self.headed = headed  # the divergence header was checked before the payload (faults.check_collective)
        self.done = False
        self._outs: list[torch.Tensor] = []
        self._trailers: torch.Tensor | None = None

    def deliver(self, lo: int, hi: int, rows: torch.Tensor) -> None:
        """Columns ``[lo, hi)`` of every rank's row (collectives.all_gather_delivered): the parameters' part
        straight into their buffers, the divergence trailers aside for the check after the wait."""
        span = self.layout.shard_numel
        if lo < span:
            self.layout.unpack_columns(rows[:, :min(hi, span) - lo], 0, self._outs, lo)
        if hi > span:
            a = max(lo, span)
            self._trailers[:, a - span:hi - span].copy_(rows[:, a - lo:])

    def wait(self) -> None:
        if self.done:
            return
        g = self.gatherer
        span = self.layout.shard_numel
        dtype = self.packed.dtype if self.packed is not None else self.send.dtype
        with contextlib.ExitStack() as refills:
            try:
                if self.packed is None:  # delivered during the wait: the buffers first
                    self._outs = self._take_outs(dtype, self.send.device, refills)
                    self._trailers = torch.empty((g.world_size, TRAILER_NUMEL), dtype=dtype)
                with g.timers.phase("communication"):
                    wait_or_diagnose(self.work, g.timeout_s, self.label, self.seq, g.group)
                if g.world_size > 1:
                    g.check_trailers(self.packed[:, span:] if self.packed is not None else self._trailers,
                                     headed=self.headed)
            except BaseException:
                # The parameters were never gathered; leave them PARTITIONED so the error is raised once, not
                # again by every later wait on this gather.
                self.done = True
                self.packed = self.work = self.send = None
                self._outs, self._trailers = [], None
                for sp in self.sps:
                    sp.abort_gathering()
                raise
            if self.packed is not None:
                self._outs = self._take_outs(dtype, self.packed.device, refills)
                self.layout.unpack(self.packed[:, :span], 0, self._outs)
        if self.packed is not None:
            give_packed(self.packed, g.group)  # (send is a view of it)
        else:
            buffer_pool.give(self.send)
        outs, self._outs, self._trailers = self._outs, [], None
        self.packed = self.work = self.send = None
        self.done = True
        for sp, out in zip(self.sps, outs):
            sp.to_available(out if out.dtype == sp.dtype else out.to(sp.dtype))
            g.count_live(sp, +1)

    def _take_outs(self, dtype: torch.dtype, device, refills: contextlib.ExitStack) -> list[torch.Tensor]:
        outs = []
        for sp in self.sps:
            out = sp.take_parked() if sp.dtype == dtype else None
            if out is None:  # a kept buffer (comm/buffer_pool.py): no fresh mmap to fault in
                out = buffer_pool.take(sp.numel, dtype, device, fit=GATHERED_FIT)
            else:  # the same values again, into storage that views saved by autograd still point at
                refills.enter_context(torch.autograd._unsafe_preserve_version_counter(out))
            outs.append(out)
        return outs


# GPU trailers set aside before they are checked anyway: one host sync per this many gathers at most (an iteration
# of a large model gathers hundreds of modules; the runtime checks at each iteration's boundary besides)
_MAX_UNCHECKED = 256


class Gatherer:
    """Issues the gathers of one process group and checks that all its ranks gather the same parameters."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.timeout_s = DEFAULT_DIVERGENCE_TIMEOUT_S
        # with comms_divergence_check off, still check every gather of the recorded first iteration (a
        # Stage3Runtime turns this off once its gather order is recorded)
        self.header_checks = True
        self.timers = NO_TIMERS  # the engine's: time blocked waiting for a gather counts as "communication"
        # where gathered parameters are computed with: the GPU this process trains on, whatever the shards' home
        # (offload_param keeps them in host memory or swap files); on a CPU run, the shards' own device
        self.device = accelerator_device()
        if self.world_size > 1:
            faults.channel_for(group)  # created now, at the first partition, where every rank comes (collective)
            shm_ring.ring_for(group)  # likewise (one host, CPU: the packed buffers in shared memory)
        self.seq = 0
        self._labels: dict[int, str] = {}
        self.live_numel = 0
        self.live_bytes = 0
        self.peak_live_bytes = 0
        # Trailers of asynchronous gathers set aside for a later check (check_trailers): on a GPU, device copies
        # read back in one transfer. A CPU run checks each at once (nothing to save); a test may set it to run the
        # deferred path on the CPU.
        self.defer_trailer_checks = self.device is not None and self.device.type == "cuda"
        self._unchecked: list[torch.Tensor] = []
        self.deferred_trailer_checks = 0  # statistics: gathers whose trailers were checked by check_deferred
        self.gather_count = 0        # statistics, read by tests and the profiler
        self.header_check_count = 0
        self.gathered_numel = 0

    # ------------------------------------------------------------------ naming
    def register_label(self, sps: list[ShardedParam], label: str) -> int:
        key = params_key(sp.ds_id for sp in sps)
        self._labels.setdefault(key, label)
        return key

    def describe(self, key: int) -> str:
        return self._labels.get(key, f"<parameters with key {key:#08x}>")

    # ------------------------------------------------------------------ divergence trailers
    def check_trailers(self, tails: torch.Tensor, headed: bool) -> None:
        """Check one gather's trailers (divergence.py), ``tails`` (world_size, TRAILER_NUMEL).

        On a GPU reading them back stops the host at every gather until the GPU gets there, so no prefetch could
        run ahead. Where the gather's divergence header was checked before the payload (``headed``: the default,
        ``comms_divergence_check``), that header already compared every rank's gather -- its label is in it --
        and the trailer is a second check that can wait: it is copied aside on the device and checked with the
        others in one transfer by :meth:`check_deferred`, which the runtime calls at each forward's and
        backward's boundary (GatheredParameters and the state-dict consolidation when their gathers are done).
        Without a header the trailer is the only check, and it runs at once, on a GPU too: a late check would let
        diverged ranks go on into collectives that do not match (the price of turning the header off). On a CPU
        run every check runs at once (nothing to save)."""
        if not (headed and self.defer_trailer_checks):
            check_trailers(tails, self.rank, self.describe, self.group)
            return
        self._unchecked.append(tails.clone())  # the packed buffer is reused: the bytes must be kept
        if len(self._unchecked) >= _MAX_UNCHECKED:
            self.check_deferred()

    def check_deferred(self) -> None:
        """Check the trailers :meth:`check_trailers` set aside, in gather order (one device-to-host copy)."""
        if not self._unchecked:
            return
        pending, self._unchecked = self._unchecked, []
        self.deferred_trailer_checks += len(pending)
        for tails in torch.stack(pending).cpu():
            check_trailers(tails, self.rank, self.describe, self.group)

    # ------------------------------------------------------------------ collectives
    def gather(self, sps: list[ShardedParam], label: str, *, async_op: bool = False,
               header_check: bool | None = None, alias: bool = True) -> PendingGather | None:
        """Start (and unless ``async_op``, finish) one packed all-gather of the PARTITIONED ``sps``.

        ``alias``: in a world of one, a parameter whose shard is in memory on the compute device becomes a view
        of that shard -- no buffer, no copy, nothing to free -- so ZeRO-3 on one GPU costs what stage 0 does
        (returns None: nothing is in flight). False where the caller's edits must not reach the shard
        (GatheredParameters without a modifier rank discards them)."""
        assert sps and all(sp.state is ParamState.PARTITIONED for sp in sps), [repr(sp) for sp in sps]
        key = self.register_label(sps, label)
        self.gather_count += 1
        self.gathered_numel += sum(sp.numel for sp in sps)
        if alias and self.world_size == 1:
            device = self.device or sps[0].storage.device
            if all(sp.can_alias_shard(device) for sp in sps):
                for sp in sps:
                    sp.to_available(None)
                    self.count_live(sp, +1)
                return None
        seq = self.seq
        self.seq += 1
        layout = ShardLayout(tuple(sp.numel for sp in sps), self.world_size)
        span = layout.shard_numel
        force = header_check if header_check is not None else self.header_checks
        headed = self.world_size > 1 and (force or faults.checks_enabled())
        if headed:
            self.header_check_count += 1  # all_gather_packed runs it, before the payload
        dtype = sps[0].dtype
        device = self.device or sps[0].storage.device
        # None where the group's ring turns a buffer this large down: then gathered chunk by chunk through the
        # ring straight into the parameters' buffers, with no private packed buffer (PendingGather.deliver)
        packed = take_gather_buffer((self.world_size, span + TRAILER_NUMEL), dtype, device, self.group,
                                    f"the gather of {label}", self.timeout_s, private_if_refused=False)
        # in place: this rank's row of the output is what it sends (NCCL and the per-row gloo path both take it)
        send = packed[self.rank] if packed is not None else buffer_pool.take(span + TRAILER_NUMEL, dtype, device)
        # Each shard straight into the send row, from memory or (offload_param nvme) from its swap file. Shards
        # kept off the device (offload_param) are read into pinned host memory first, then copied over in one
        # asynchronous transfer: swap-file reads need host memory, and one copy beats one per parameter.
        staged = device.type != "cpu" and any(sp.storage.device != device for sp in sps)
        row = torch.empty(span, dtype=dtype, pin_memory=True) if staged else send
        reads = [sp.storage.read_async(row[layout.offsets[i]:layout.offsets[i + 1]]) for i, sp in enumerate(sps)]
        reads = [f for f in reads if not f.done() or f.exception() is not None]  # resident copies are done
        if reads:
            with self.timers.phase("offload_io"):
                wait_all(reads)
        if staged:
            send[:span].copy_(row, non_blocking=True)  # the caching host allocator keeps `row` until it is done
        if self.world_size > 1:  # a world of one has no other row to compare with (and a GPU no sync to spend)
            write_trailer(send[span:], key, seq)
        # async: the header check is deferred (comm/faults.check_deferred), no rank waits for the others here
        if packed is None:
            pending = PendingGather(self, list(sps), layout, None, None, key, seq, label, send=send, headed=headed)
            pending.work = all_gather_delivered(send, pending.deliver, group=self.group, what=f"the gather of {label}",
                                                force_check=force, defer_check=async_op)
        else:
            work = all_gather_packed(packed, send, group=self.group, async_op=True, what=f"the gather of {label}",
                                     force_check=force, defer_check=async_op)
            pending = PendingGather(self, list(sps), layout, packed, work, key, seq, label, headed=headed)
        for sp in sps:
            sp.to_gathering(pending)
        if not async_op:
            pending.wait()
        return pending

    def wait_available(self, sp: ShardedParam) -> None:
        if sp.state is ParamState.GATHERING:
            sp.pending.wait()

    def release(self, sp: ShardedParam, *, park: bool = False) -> None:
        """PARTITIONED again (waits for an in-flight gather first). No-op for persistent or partitioned params.
        ``park``: free the full buffer's storage in place (forward-pass releases; see ShardedParam.to_partitioned)."""
        if sp.persistent or sp.state is ParamState.PARTITIONED:
            return
        self.wait_available(sp)
        sp.to_partitioned(park=park)
        self.count_live(sp, -1)

    def count_live(self, sp: ShardedParam, sign: int) -> None:
        self.live_numel += sign * sp.numel
        self.live_bytes += sign * sp.numel * sp.dtype.itemsize
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def reset_peak(self) -> None:
        self.peak_live_bytes = self.live_bytes


_LONE: Gatherer | None = None  # no process group: a world of one has nothing to close


def gatherer_for(group=None) -> Gatherer:
    """The Gatherer of ``group`` (None: the default group), kept in the group's communication context (comm/context.py,
    closed with the group). Created on first use -- a collective, so every rank of the group must make that first
    call at the same point (partitioning a parameter does)."""
    global _LONE
    if not dist.is_initialized():
        if _LONE is None:
            _LONE = Gatherer(None)
        return _LONE
    return context.get(group).attachment("gatherer", lambda: Gatherer(group))
