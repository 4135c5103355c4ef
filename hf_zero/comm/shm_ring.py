"""Same-host CPU ranks exchange ZeRO's packed buffers through shared memory instead of gloo's TCP loopback.

Why: on CPU every byte gloo moves between two processes of one host is copied into a socket and out of it again,
on gloo's threads, which compete with the compute threads for the same cores. ZeRO-3 moves the whole model twice a
step (the forward's and the backward's gathers) and its gradient once. Measured on the 2-core machine, 2 ranks,
gathering 16 MB: 7-9 ms wall and 5 ms CPU per rank with gloo, against 1-2 ms to copy the same 16 MB in memory.

How: one shared memory file per process group (an anonymous memfd the other ranks open through rank 0's
``/proc/<pid>/fd``, so a kill during set-up leaves nothing behind; where that is refused, a ``/dev/shm`` file whose
name every rank computes beforehand, unlinked once every rank has mapped it or by any rank whose set-up failed)
holds a ring of buffers, kept in the group's context (context.py) and dropped when the group is closed. A packed
buffer (zero/layout.py) is *taken* from the ring, so what a rank writes there is already where the other ranks read
it (shm_collectives.py: ZeRO-3's gathers pack straight into it; gradient buckets are packed into it chunk by chunk
at the reduce-scatter). A collective is then only a flag per rank:

- all-gather: each rank writes its row of the shared ``(world, span)`` buffer and publishes it; the gather is
  complete once every rank has published (the caller unpacks straight from the shared rows);
- reduce-scatter: each rank writes its whole ``(world, span)`` bucket (its own block of a shared
  ``(world, world, span)`` buffer) and publishes it; rank ``r`` then sums row ``r`` of every rank's block, in rank
  order (the same sum on every run).

Every rank takes and gives back ring buffers in the same program order (the collectives are the same on every rank,
which the divergence checks enforce), so the ring's offsets agree without any exchange. A buffer is reused only
once every rank has given it back (a flag per rank and buffer); a rank that gets ahead waits for that, bounded. A
request that does not fit (larger than half the ring, or onto a buffer this rank still holds) gets ``None`` from
the ring -- the same answer on every rank -- and the caller falls back to gloo.

Waits are bounded like every hf_zero collective: the caller's timeout (comms_timeout_s), a peer process that has
died is noticed within :data:`_LIVENESS_PERIOD_S` (its pid is in the shared header), and the fault channel
diagnoses either (comm/faults.py).

Enabled for a process group whose backend is gloo, world size above one, every rank on one host (each rank opens
the file by name; a rank on another host cannot), on x86-64 (whose stores are seen by other cores in program
order: the payload before its flag). ``HF_ZERO_SHM_COMM=0`` turns it off (the collectives are then gloo's);
``HF_ZERO_SHM_COMM_MIB`` sizes the ring (default :data:`DEFAULT_RING_BYTES` at ZeRO-3, :data:`BOUNCE_RING_BYTES` at
stages 1-2).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import secrets
import time

import torch
import torch.distributed as dist

from hf_zero.util.env import env_flag

from . import context

__all__ = ["ShmRing", "ring_for", "existing", "give", "is_ring_memory", "enabled",
           "DEFAULT_RING_BYTES", "BOUNCE_RING_BYTES"]

# ZeRO-3 gathers in place: its ring holds the largest module gathered at once (the 32M Llama's 16 MiB embedding) with
# room for the next; stages 0-2 only bounce (shm_collectives.py), 1 MiB chunks through a small ring. Every page of a
# ring ends up touched, so its size counts in each rank's resident set.
DEFAULT_RING_BYTES = 32 << 20
BOUNCE_RING_BYTES = 8 << 20
_SLOTS = 64            # buffers in flight that the flags tell apart; more are refused (a fallback), never mixed up
_ALIGN = 4096
_HEADER_WORDS = 2      # magic, nonce
_LIVENESS_PERIOD_S = 0.25
_SPIN_CHECKS = 200     # flag checks before the wait starts to sleep between them (a busy peer is not starved)
_MAX_SLEEP_S = 1e-3


def enabled() -> bool:
    return env_flag("HF_ZERO_SHM_COMM", True)


def _ring_bytes(default: int) -> int:
    value = os.environ.get("HF_ZERO_SHM_COMM_MIB", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"HF_ZERO_SHM_COMM_MIB={value!r}: the shared ring's size in MiB, a positive integer")
        return int(value) << 20
    return default


class _Region:
    __slots__ = ("seq", "slot", "start", "end", "view", "held", "kind")

    def __init__(self, seq: int, start: int, end: int, view: torch.Tensor, kind: str) -> None:
        self.seq, self.slot, self.start, self.end = seq, seq % _SLOTS, start, end
        self.view, self.held, self.kind = view, True, kind


class ShmRing:
    """The shared ring of one process group; see the module docstring. Built collectively by :func:`ring_for`."""

    def __init__(self, mem: torch.Tensor, group, rank: int, world: int, pids: list[int]) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.mem = mem  # uint8, the whole mapping
        header_bytes = -(-_header_words(world) * 8 // _ALIGN) * _ALIGN
        # the flags through ctypes: a read or write is ~0.1 us, a torch indexing op ~10 us (thousands per step).
        # published[r][slot] at r * _SLOTS + slot, then freed[r][slot], then the divergence headers' flags
        # (hdr[r][slot]), each rank's latest header, and the headers' values (5 words per rank and slot)
        flags = (ctypes.c_int64 * (_header_words(world) - _HEADER_WORDS)).from_address(
            mem.data_ptr() + 8 * _HEADER_WORDS)
        self._flags = flags
        self._freed0 = world * _SLOTS
        self._hdr0 = 2 * world * _SLOTS
        self._latest0 = 3 * world * _SLOTS
        self._vals0 = 3 * world * _SLOTS + world
        self._hdr_first: int | None = None  # the first header sequence number exchanged here
        self.data = mem[header_bytes:]
        self.size = self.data.numel()
        self.pids = pids
        self.seq = 0
        self.head = 0
        self._regions: list[_Region] = []  # taken, and not yet known to be given back by every rank; oldest first
        self._by_ptr: dict[int, _Region] = {}
        self.taken = 0      # statistics: buffers served from the ring, and requests it turned down
        self.refused = 0

    def close(self) -> None:
        """Drop this rank's mapping (GroupComm.close): the memory goes with the last view of it. The flags are
        cleared first, so a use after close fails in Python instead of reading unmapped memory."""
        self._flags = None
        self._regions, self._by_ptr = [], {}
        self.mem = self.data = None
        self.group = None

    # ---- the ring ---------------------------------------------------------------------------------------------------
    def _take(self, nbytes: int, kind: str, what: str, timeout_s: float) -> _Region | None:
        nbytes = -(-nbytes // 64) * 64
        oldest = self._regions[0] if self._regions else None
        if nbytes > self.size * 3 // 4 or (oldest is not None and self.seq - oldest.seq >= _SLOTS and oldest.held):
            self.refused += 1  # too large, or its flags' slot is still in use here: the same answer on every rank
            return None
        held = [r for r in self._regions if r.held]
        # first fit from the head, then after each buffer this rank still holds, then from the start; buffers
        # nobody holds any more are overwritten once every rank has given them back
        start = None
        for cand in [self.head] + [r.end for r in held] + [0]:
            if cand + nbytes <= self.size and not any(r.start < cand + nbytes and cand < r.end for r in held):
                start = cand
                break
        if start is None:
            self.refused += 1
            return None
        end = start + nbytes
        blocking = [r for r in self._regions if r.start < end and start < r.end]
        if oldest is not None and self.seq - oldest.seq >= _SLOTS and oldest not in blocking:
            blocking.append(oldest)  # its flags' slot is about to be reused
        for r in blocking:
            self._wait_freed(r, what, timeout_s)
        self._regions = [r for r in self._regions if r not in blocking]
        seq = self.seq
        self.seq += 1
        self.head = end
        region = _Region(seq, start, end, self.data[start:end], kind)
        self._regions.append(region)
        self.taken += 1
        return region

    def take_gather(self, shape: tuple[int, int], dtype: torch.dtype, what: str = "a gather",
                    timeout_s: float = 300.0) -> torch.Tensor | None:
        """A shared ``(world, span)`` buffer: this rank writes its row, every rank reads every row."""
        rows, span = shape
        assert rows == self.world
        region = self._take(rows * span * dtype.itemsize, "gather", what, timeout_s)
        if region is None:
            return None
        t = region.view[:rows * span * dtype.itemsize].view(dtype).view(rows, span)
        self._by_ptr[t.data_ptr()] = region
        region.view = t
        return t

    def take_reduce(self, shape: tuple[int, int], dtype: torch.dtype, what: str = "a reduce-scatter",
                    timeout_s: float = 300.0) -> torch.Tensor | None:
        """This rank's ``(world, span)`` block of a shared ``(world, world, span)`` buffer: it packs its whole
        bucket there, and rank ``r`` reads row ``r`` of every block."""
        rows, span = shape
        assert rows == self.world
        region = self._take(self.world * rows * span * dtype.itemsize, "reduce", what, timeout_s)
        if region is None:
            return None
        full = region.view[:self.world * rows * span * dtype.itemsize].view(dtype).view(self.world, rows, span)
        t = full[self.rank]
        region.view = full
        self._by_ptr[t.data_ptr()] = region
        return t

    def region_of(self, t: torch.Tensor) -> _Region | None:
        return self._by_ptr.get(t.data_ptr()) if t.device.type == "cpu" else None

    def give(self, t: torch.Tensor) -> bool:
        """This rank is done with ``t`` (a buffer from a take); False if ``t`` is not one."""
        region = self._by_ptr.pop(t.data_ptr(), None)
        if region is None:
            return False
        region.held = False
        self._flags[self._freed0 + self.rank * _SLOTS + region.slot] = region.seq
        return True

    # ---- the collective: flags --------------------------------------------------------------------------------------
    def publish(self, region: _Region) -> None:
        """This rank's part of ``region`` is written (the caller's copy returned before this store)."""
        self._flags[self.rank * _SLOTS + region.slot] = region.seq

    def _laggards(self, base: int, region: _Region) -> list[int]:
        flags, slot, seq = self._flags, region.slot, region.seq
        return [r for r in range(self.world) if flags[base + r * _SLOTS + slot] != seq]

    def ready(self, region: _Region) -> bool:
        return not self._laggards(0, region)

    def wait_ready(self, region: _Region, what: str, timeout_s: float) -> None:
        self._spin(lambda: self._laggards(0, region), what, timeout_s, "has not written its part")

    def _wait_freed(self, region: _Region, what: str, timeout_s: float) -> None:
        self._spin(lambda: self._laggards(self._freed0, region), f"reusing shared memory for {what}", timeout_s,
                   "has not finished reading an earlier buffer")

    # ---- the divergence check's header (comm/faults.py), exchanged here instead of by a gloo all-gather -------------
    def exchange_header(self, seq: int, mine: list[int], rows: torch.Tensor, what: str,
                        timeout_s: float) -> "HeaderWork":
        """Publish this rank's 5-integer header of collective ``seq`` of the fault channel; the returned work's
        ``wait()`` fills ``rows`` (world * 5) with every rank's. A rank publishes header ``seq`` only after it has
        read every header up to ``seq - 2`` (the channel defers at most one check), so slot ``seq % _SLOTS`` is free
        once every rank has published ``seq - _SLOTS + 2``."""
        if self._hdr_first is None:
            self._hdr_first = seq
        slot = seq % _SLOTS
        flags = self._flags
        if seq - _SLOTS >= self._hdr_first:
            need = seq - _SLOTS + 2
            self._spin(lambda: [r for r in range(self.world) if flags[self._latest0 + r] < need],
                       f"reusing shared memory for the check before {what}", timeout_s,
                       "has not read an earlier check")
        base = self._vals0 + (self.rank * _SLOTS + slot) * 5
        for i, v in enumerate(mine):
            flags[base + i] = int(v)
        flags[self._hdr0 + self.rank * _SLOTS + slot] = seq
        flags[self._latest0 + self.rank] = seq
        return HeaderWork(self, seq, slot, rows)

    def _spin(self, laggards, what: str, timeout_s: float, why: str) -> None:
        if not laggards():
            return

        def done() -> bool:
            return not laggards()

        start = time.monotonic()
        next_liveness = start + _LIVENESS_PERIOD_S
        checks, sleep = 0, 1e-5
        while not done():
            checks += 1
            if checks > _SPIN_CHECKS:
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP_S)
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_PERIOD_S
                self._check_peers_alive(what)
                if now - start > timeout_s:
                    ranks = [_global(self.group, r) for r in laggards()]
                    raise TimeoutError(f"hf_zero shared-memory collective timed out after {timeout_s:g}s in {what}: "
                                       f"rank(s) {ranks} {why}")

    def _check_peers_alive(self, what: str) -> None:
        for r, pid in enumerate(self.pids):
            if r != self.rank and _dead(pid):
                raise ConnectionResetError(f"connection closed: rank {_global(self.group, r)} (pid {pid}) died "
                                           f"while this rank was in {what}")


class HeaderWork:
    """A header exchange in the ring (:meth:`ShmRing.exchange_header`), waited like a gloo work."""

    def __init__(self, ring: ShmRing, seq: int, slot: int, rows: torch.Tensor) -> None:
        self.ring, self.seq, self.slot, self.rows = ring, seq, slot, rows
        self._done = False

    def _laggards(self) -> list[int]:
        ring, flags = self.ring, self.ring._flags
        return [r for r in range(ring.world) if flags[ring._hdr0 + r * _SLOTS + self.slot] != self.seq]

    def is_completed(self) -> bool:
        return self._done or not self._laggards()

    def wait(self, timeout=None) -> bool:
        if self._done:
            return True
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        ring, flags = self.ring, self.ring._flags
        ring._spin(self._laggards, f"the divergence check of collective #{self.seq}",
                   300.0 if seconds is None else float(seconds), "has not reached this collective")
        values = []
        for r in range(ring.world):
            base = ring._vals0 + (r * _SLOTS + self.slot) * 5
            values.extend(flags[base:base + 5])
        self.rows.copy_(torch.tensor(values, dtype=torch.int64))
        self._done = True
        return True


def _header_words(world: int) -> int:
    return _HEADER_WORDS + 3 * world * _SLOTS + world + 5 * world * _SLOTS


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


# ---- one ring per process group, in the group's context (context.py) --------------------------------------------------
_MAGIC = 0x6866_7A65_726F_5348  # "hfzeroSH"


def ring_for(group=None, nbytes: int = DEFAULT_RING_BYTES) -> ShmRing | None:
    """The ring of ``group``, built on first use -- a collective: every rank of the group must make that first call
    at the same point (ZeRO-3 makes it where it partitions the first parameter). None where it does not apply.
    ``nbytes``: the ring's size if this call builds it (HF_ZERO_SHM_COMM_MIB overrides it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    # a group destroyed and created again in the same processes (tests, a second initialize) is a new group object,
    # so a new context and a fresh ring, never one whose buffers an aborted collective may have left half used
    ctx = context.get(group)
    if ctx.ring_decided:
        return ctx.ring
    ring = None
    world = dist.get_world_size(group)
    if world > 1 and dist.get_backend(group) == "gloo":
        # every rank of the group takes part in the vote below, whatever it concludes locally
        ring = _open(group, dist.get_rank(group), world, _ring_bytes(nbytes), usable=enabled() and _platform_ok(),
                     name=_file_name(ctx.key, ctx.incarnation))
    ctx.ring, ctx.ring_decided = ring, True
    return ring


def _platform_ok() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm") and os.path.isdir("/proc")


_KINDS = ("memfd", "file")  # tried in this order (a test narrows it to the fallback)
_PENDING: set[str] = set()  # named files created or expected here and not unlinked yet (see unlink_pending)


def _open(group, rank: int, world: int, size: int, usable: bool, name: str) -> ShmRing | None:
    # An anonymous memory file first (memfd): it has no name anywhere, so a rank killed during set-up leaves nothing
    # behind -- the memory goes when the last process holding it does. The other ranks open it through rank 0's
    # /proc/<pid>/fd/<n>, which needs the same user and /proc; where that fails (every rank learns it in the vote),
    # a named /dev/shm file, unlinked once every rank has mapped it -- and, if set-up fails on any rank (a peer
    # killed, a fault exit), by every rank that can: its name is known to all of them before it exists.
    for kind in _KINDS:
        ring = _open_as(kind, group, rank, world, size, usable, name)
        if ring is not None:
            return ring
    return None


def _file_name(key: str, incarnation: int) -> str:
    """The fallback file's path, computed alike on every rank of the group with no message: the rendezvous address
    and port (no two live jobs of one host share them), torchrun's run id and restart count, the group's key
    (context.group_key) and how many earlier groups of that key these processes had."""
    parts = [os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                             "TORCHELASTIC_RESTART_COUNT")]
    digest = hashlib.sha1(repr((parts, key, incarnation)).encode()).hexdigest()[:20]
    return f"/dev/shm/hf_zero_comm_{digest}"


_next_name = ""  # the fallback file the set-up in progress creates (set just before _create; one set-up at a time)


def _create(kind: str, size: int) -> tuple[int, str]:
    """A shared memory file of ``size`` bytes: (fd, the path the other ranks open)."""
    if kind == "memfd":
        fd = os.memfd_create("hf_zero_comm", os.MFD_CLOEXEC)
        path = f"/proc/{os.getpid()}/fd/{fd}"
    else:
        path = _next_name
        _PENDING.add(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # left by an earlier job on this address and port that was killed: stale
            os.unlink(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        if kind == "file":
            _unlink(path)
        raise
    return fd, path


def _unlink(path: str) -> None:
    _PENDING.discard(path)
    try:
        os.unlink(path)
    except OSError:
        pass


def unlink_pending() -> None:
    """Remove the named ring files a set-up of this process has not finished with (faults.py calls it before a fault
    exit, which skips every ``finally``)."""
    for path in list(_PENDING):
        _unlink(path)


def _open_as(kind: str, group, rank: int, world: int, size: int, usable: bool, name: str) -> ShmRing | None:
    if kind == "file":
        _PENDING.add(name)  # every rank: whichever survives a failed set-up removes it
    try:
        return _set_up(kind, group, rank, world, size, usable, name)
    finally:
        if kind == "file":
            # mapped by every rank (the mappings keep the memory), or set-up failed: the name goes either way
            _unlink(name)


def _set_up(kind: str, group, rank: int, world: int, size: int, usable: bool, name: str) -> ShmRing | None:
    global _next_name
    src = _global(group, 0)
    info = [None]
    fd = None
    if rank == 0 and usable and (kind == "file" or hasattr(os, "memfd_create")):
        _next_name = name
        try:
            fd, path = _create(kind, size)
            info = [(path, secrets.randbits(62), size)]
        except OSError:
            fd, info = None, [None]
    try:
        dist.broadcast_object_list(info, src=src, group=group)
        mem = None
        if info[0] is not None and usable:
            path_, nonce, size_ = info[0]
            try:
                # open it first without creating it: torch.from_file would create a file of zeros on another host
                os.close(os.open(path_, os.O_RDWR))
                mem = torch.from_file(path_, shared=True, size=size_, dtype=torch.uint8)
                if rank == 0:
                    words = _header_words(world)
                    mem[:words * 8].view(torch.int64).fill_(-1)  # no buffer published or given back, no header yet
                    mem[:16].view(torch.int64).copy_(torch.tensor([_MAGIC, nonce]))
            except (OSError, RuntimeError):
                mem = None
        # rank 0 wrote the nonce before this vote; a rank that sees another file of that name (another host) fails
        votes = [None] * world
        dist.all_gather_object(votes, (os.getpid(), mem is not None), group=group)
        ok = all(v[1] for v in votes)
        if ok:
            mine = mem[:16].view(torch.int64).tolist()
            verdicts = [None] * world
            dist.all_gather_object(verdicts, mine == [_MAGIC, info[0][1]], group=group)
            ok = all(verdicts)
    finally:
        if fd is not None:
            # every rank that could map it has (or set-up failed): the mappings keep the memory
            os.close(fd)
    if not ok:
        return None
    return ShmRing(mem, group, rank, world, [v[0] for v in votes])


def existing(group=None) -> ShmRing | None:
    """The ring of ``group`` if :func:`ring_for` built one (no collective)."""
    ctx = context.lookup(group)
    return ctx.ring if ctx is not None else None


def is_ring_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in any ring (such memory must never reach buffer_pool)."""
    if t.device.type != "cpu":
        return False
    rings = [ctx.ring for ctx in context.contexts() if ctx.ring is not None]
    if not rings:
        return False
    ptr = t.untyped_storage().data_ptr()
    return any(ring.mem.untyped_storage().data_ptr() == ptr for ring in rings)


def give(t: torch.Tensor | None, group=None) -> bool:
    """Give back a ring buffer (True), or do nothing for any other tensor (False)."""
    if t is None:
        return False
    ring = existing(group)
    return ring is not None and ring.give(t)
