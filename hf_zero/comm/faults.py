"""Bounded collectives: a fault on one rank ends the job on every rank, with an error that names the real cause.

What goes wrong in a data-parallel job is rarely visible from the rank that notices it: a rank that is stopped,
dead, out of disk, or running another module than its peers leaves the others blocked in a collective, and gloo
ignores wait timeouts in places (its reduce-scatter) and hangs on exit with work in flight. One
:class:`FaultChannel` per process group closes these gaps:

* **Every wait is bounded** by ``comms_timeout_s`` (config; default :data:`DEFAULT_TIMEOUT_S`): the wait itself
  where the backend honours a timeout, the process group's own timeout (set to the same value) where it does not,
  and a watchdog thread that ends the process ``grace`` seconds after a wait overran, whatever the backend does.
* **Every collective is checked before it is issued** (``comms_divergence_check``): a 5-integer all-gather of
  (kind, elements, dtype, sequence number, label hash). All ranks compare the headers, so ranks that run a
  different module, an extra micro-batch or skip a call fail on every rank at once, naming what each rank was
  about to do -- before a payload of a different size reaches gloo (which aborts the process) or NCCL (which hangs).
  A run of collectives issued back to back from one call (the buckets of a publishing all-gather) is checked
  once, with one header for the whole run (:func:`check_run`): nothing else can be issued between them, so what
  one header proves for the first holds for the rest, and each check is a wait on every rank (a barrier).
  A collective whose result is needed later (ZeRO-3's prefetch, a reduce-scatter overlapping backward) may have
  its check *deferred* (:func:`check_deferred`): the header is all-gathered asynchronously and the payload issued
  once the header is verified -- at the next collective of the channel, or when the result is waited for,
  whichever comes first. The payload still never leaves before its header is verified, and every rank issues it
  at the same point of its program, but no rank waits for the others at the moment it asks for the collective.
* **The first fault is published** in the launcher's key-value store (the one the process group was rendezvoused
  through): a divergence, a timeout with the ranks that stopped answering (stopped, dead, or alive elsewhere --
  told apart by heartbeats and, on one host, by the peer's process state), or any exception that escapes the
  script (a full disk, a user error). Every other rank reads it: a rank blocked in a collective that will never
  finish prints the published cause and exits; a rank that raised exits when Python exits. Exit is ``os._exit``
  with status 1, because a process group with work in flight blocks interpreter shutdown forever. Once such an
  exception has reached the top of the script, the exit is also bounded by a timer (``3 * grace + 1`` s): whatever
  in the shutdown might still block -- another library's exception hook or exit handler -- the process ends.
* **Where a rank that never came is**: a rank that is alive but runs other code (a data loader that hangs, a
  branch the others did not take) is asked, through the store, for its main thread's stack; its watchdog thread
  answers within a period, and the error the waiting rank raises ends with that stack. The rank itself prints it
  as it exits.

The channel keeps no state in the steady state beyond a heartbeat (one store write and one key check per
``period``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import sys
import threading
import time
import traceback
import logging
import zlib

import torch
import torch.distributed as dist

from . import context, shm_ring
from .process_group import bookkeeping_device
from .settings import DEFAULT_TIMEOUT_S, checks_enabled, configure, created_by_hf_zero, default_timeout_s, timeout_s

__all__ = ["CommFault", "DivergenceError", "PeerFailure", "DEFAULT_TIMEOUT_S", "configure", "channel_for",
           "configure_from", "timeout_s", "default_timeout_s", "bounded_wait", "bounded", "check_collective",
           "check_run", "check_deferred", "settle", "settle_if_ready", "checks_enabled", "fail", "bound_group",
           "is_comm_error"]

logger = logging.getLogger("hf_zero")

_GRACE_MAX_S = 5.0


class CommFault(RuntimeError):
    """A collective could not complete; the process group is unusable and this process will exit non-zero."""


class DivergenceError(CommFault):
    """Ranks were about to issue different collectives (another module, an extra or a missing call)."""


class PeerFailure(CommFault):
    """A rank stopped answering, died, or failed with an error of its own (named in the message)."""


# the channels live in their groups' contexts (context.py); this lock only serialises building one
_lock = threading.Lock()


def configure_from(config, group=None) -> None:
    """Apply an HfZeroConfig's ``comms_timeout_s`` / ``comms_divergence_check`` (kept on by
    ``zero_optimization.enable_sanity_checks``: DeepSpeed's ZeRO-3 sanity checks compare the ranks' parameter ids
    before its gathers and reductions, which the per-collective check does for every collective). The group's own
    timeout is set where hf_zero created the group; a group the application created keeps its timeout (it may bound the
    application's own long barriers), with a warning when that is longer -- hf_zero's collectives are bounded by
    the watchdog either way."""
    seconds = config.comms_timeout_s if config.comms_timeout_s is not None else timeout_s()
    configure(timeout_s=seconds, divergence_check=config.comms_divergence_check or config.zero.enable_sanity_checks)
    for ch in _channels():  # built before this config was read (the device mesh's barrier): its bounds follow
        ch.follow_timeout()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if created_by_hf_zero() or group is not None:
            _apply_pg_timeout(group, seconds)
        elif config.comms_timeout_s is not None:
            logger.warning("hf_zero: the default process group was created by the application with its own timeout "
                           "(torch's default is 30 min); comms_timeout_s=%gs bounds hf_zero's collectives only. Pass "
                           "timeout=datetime.timedelta(seconds=%g) to init_process_group to bound the rest too.",
                           seconds, seconds)


def bound_group(group) -> None:
    """Give ``group`` (one hf_zero made: pipeline or TP groups) the comms timeout as its own, so the calls hf_zero
    cannot wrap -- torch.distributed.pipelining's sends and receives, DTensor's collectives -- end within the same
    bound and fail into the same diagnosis."""
    if dist.is_available() and dist.is_initialized() and group is not None and dist.get_world_size(group) > 1:
        _apply_pg_timeout(group, timeout_s())


def _apply_pg_timeout(group, seconds: float) -> None:
    # gloo's reduce-scatter (and its transport) honour only the group's own timeout, not Work.wait(timeout)
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(datetime.timedelta(seconds=seconds), group)


def channel_for(group=None) -> "FaultChannel | None":
    """The channel of ``group`` (None: the default group), kept in the group's context (context.py); None for a
    world of one (nothing can diverge)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    ctx = context.get(group)
    ch = ctx.channel
    if ch is None:
        with _lock:
            if ctx.channel is None:
                ctx.channel = FaultChannel(group, ctx)
            ch = ctx.channel
    return ch


def _existing(group) -> "FaultChannel | None":
    ctx = context.lookup(group)
    return ctx.channel if ctx is not None else None


def _channels() -> list:
    return [ctx.channel for ctx in context.contexts() if ctx.channel is not None]


def bounded_wait(work, what: str, group=None, timeout: float | None = None, stream_ordered: bool = False) -> None:
    """Wait for ``work`` at most ``timeout`` (default: comms_timeout_s) seconds; on failure raise the diagnosed
    :class:`CommFault` (and the process will exit non-zero). ``stream_ordered``: a collective on CUDA tensors (see
    :meth:`FaultChannel.wait`)."""
    ch = channel_for(group)
    if ch is None:
        work.wait()
        return
    ch.wait(work, what, timeout, stream_ordered=stream_ordered)


@contextlib.contextmanager
def bounded(what: str, group=None, timeout: float | None = None):
    """``with bounded("the barrier of save_checkpoint"): <blocking collective>`` -- see FaultChannel.bounded."""
    ch = channel_for(group)
    if ch is None:
        yield timeout
        return
    if ch.deferred is not None:
        ch.settle()  # a deferred payload leaves before this collective, as it was asked for first
    with ch.bounded(what, timeout) as limit:
        yield limit


def check_collective(kind: str, numel: int, dtype: torch.dtype, what: str, group=None, force: bool = False) -> bool:
    """The header check before a payload collective (see the module docstring). Skipped when
    ``comms_divergence_check`` is off, unless ``force`` (stage 3 checks its first, recorded iteration always).
    Returns whether a check ran."""
    if not (checks_enabled() or force):
        return False
    ch = channel_for(group)
    if ch is None:
        return False
    ch.check(kind, numel, dtype, what)
    return True


def check_run(items, what: str, group=None, force: bool = False, defer: bool = False) -> bool:
    """One header check for a run of collectives ``items`` -- ``(kind, numel, dtype)`` each -- that the caller
    issues next, back to back, with nothing in between: the header carries the run's length and a hash of every
    item, so ranks about to issue different runs fail here as for one collective. The following
    :func:`check_collective` calls that match the run, in order, are then free; one that does not match ends the
    run and is checked on its own. ``defer``: the header is all-gathered asynchronously and verified at the run's
    first collective (as :func:`check_deferred`). Returns whether a check ran."""
    if not (checks_enabled() or force):
        return False
    ch = channel_for(group)
    if ch is None:
        return False
    ch.check_run([(k, int(n), str(d)) for k, n, d in items], what, defer)
    return True


def check_deferred(kind: str, numel: int, dtype: torch.dtype, what: str, issue, group=None,
                   force: bool = False) -> bool:
    """The header check of a collective whose result is not needed yet: the header is all-gathered now,
    asynchronously, and ``issue()`` (which issues the payload) is called once it is verified, by :func:`settle` --
    which every later collective of the group and every wait on a result runs first. Returns False, having done
    nothing, where no check runs (the caller then issues the payload itself)."""
    if not (checks_enabled() or force):
        return False
    ch = channel_for(group)
    if ch is None:
        return False
    ch.check(kind, numel, dtype, what, issue=issue)
    return True


def settle(group=None) -> None:
    """Verify the deferred check of ``group`` (if any) and issue its payload; see :func:`check_deferred`."""
    ch = _existing(group)
    if ch is not None and ch.deferred is not None:
        ch.settle()


def settle_if_ready(group=None) -> None:
    """:func:`settle` if the deferred header has already arrived (no wait): called at every module boundary of
    ZeRO-3, so a prefetch payload leaves as soon as it may rather than when it is needed."""
    ch = _existing(group)
    if ch is not None and ch.deferred is not None and ch.deferred[0].is_completed():
        ch.settle()


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective that failed -- a peer gone, a timeout,
    an aborted group -- rather than an error of the computation around it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (CommFault, dist.DistError)):
            return True
        text = str(exc).lower()
        if any(k in text for k in ("connection closed", "connection reset", "timed out", "aborted", "broken pipe")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def fail(exc: CommFault, group=None) -> CommFault:
    """Publish ``exc`` as this job's fault and mark the process for a non-zero exit; returns ``exc`` to raise."""
    ch = channel_for(group)
    return ch.fail(exc) if ch is not None else exc


# ---------------------------------------------------------------------------------------------------------------
def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_KINDS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "barrier": 4, "broadcast": 5, "run": 6,
          "all_to_all": 7}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}


def _main_thread_stack(limit: int = 12) -> str:
    """The main thread's innermost ``limit`` frames, innermost last, as a traceback prints them (read from the
    watchdog thread: where the training loop is while the collectives wait for it)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame, limit=limit)).rstrip("\n")


def _root_store(store):
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _proc_state(pid: int) -> str | None:
    """'R', 'S', 'T' (stopped), 'Z' (zombie) ... from /proc; None when the process does not exist (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class FaultChannel:
    """The per-group fault machinery: store clients, the collective sequence, the heartbeat/watchdog thread."""

    def __init__(self, group, ctx) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.global_ranks = list(ctx.ranks)
        self.backend = dist.get_backend(group)
        self.header_device = bookkeeping_device(group)
        generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # the incarnation: a world destroyed and created again in the same processes (the same store under
        # torchrun's agent) must not read the faults or heartbeats of the one before
        self.prefix = f"hf_zero/faults/{generation}/{ctx.key}/{ctx.incarnation}/"
        self.seq = 0
        self._run: list[tuple[str, int, str]] = []  # collectives still covered by the last check_run, in order
        self.deferred = None  # (work, rows, seq, what, issue) of a check_deferred not verified yet
        self.fatal: CommFault | None = None
        self.raised = False
        self.in_wait: tuple[str, float, float] | None = None  # (what, start, timeout)
        # (what, interrupt, since): set by a caller whose blocking calls hf_zero does not issue (the pipeline's
        # StageFailureGuard while a step runs; see watch())
        self.watching: tuple[str, object, float] | None = None
        self._interrupted: tuple[str, float] | None = None
        self.suspended_s = 0.0
        self._stack_sent = False  # answered a waiting rank's request for this process's stack (diagnose)
        self.hostname = socket.gethostname()
        self._store = self._client()
        self._mon_store = self._client()  # the thread's own connection: a blocked call never holds the other
        self._store.set(self.prefix + f"proc/{self.rank}", f"{self.hostname} {os.getpid()}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="hf_zero-fault-monitor", daemon=True)
        self._thread.start()
        _install_hooks()

    # The watchdog's beat and the store's per-request bound follow comms_timeout_s as it is now: a channel can be
    # built before an engine applies the config's value (initialize's first collective is the device mesh's
    # barrier, before the config is read), and an engine built later may change it.
    @property
    def _period(self) -> float:
        return min(1.0, max(0.05, timeout_s() / 20))

    @property
    def _io_timeout_s(self) -> float:
        return min(_GRACE_MAX_S, max(1.0, timeout_s() / 4))

    def follow_timeout(self) -> None:
        """Give the store clients the current per-request bound (configure_from calls it on every live channel)."""
        io_timeout = datetime.timedelta(seconds=self._io_timeout_s)
        for client in (self._store, self._mon_store):
            if isinstance(client, dist.TCPStore):  # the channel's own clients (_client); other stores are shared
                client.set_timeout(io_timeout)

    # ---- store ---------------------------------------------------------------------------------------------------
    def _client(self):
        from torch.distributed import distributed_c10d as c10d

        root = _root_store(c10d._get_default_store())
        io_timeout = datetime.timedelta(seconds=self._io_timeout_s)
        if isinstance(root, dist.TCPStore):
            # Connecting gets the whole comms timeout: a channel is built the first time a group is used, when
            # every rank of a large job (8 processes x several groups on 2 cores) connects at once and the
            # store's single server thread accepts them one by one -- 5 s was not always enough (test_tp_3d).
            # The host being gone is still found within the bound, by the collective's own wait. Once
            # connected, each request is bounded by the short I/O timeout the watchdog relies on.
            connect = datetime.timedelta(seconds=max(timeout_s(), io_timeout.total_seconds()))
            client = dist.TCPStore(root.host, root.port, is_master=False, timeout=connect, wait_for_workers=False)
            client.set_timeout(io_timeout)
            return client
        return root  # a FileStore / HashStore: shared by the threads as is

    def _try(self, fn, *args, default=None, store=None):
        try:
            return fn(store or self._store, *args)
        except Exception:  # the store's host (usually rank 0) is gone or stopped: the caller says so
            return default

    def published(self, store=None) -> str | None:
        key = self.prefix + "fault"
        if not self._try(lambda s: s.check([key]), store=store, default=False):
            return None
        value = self._try(lambda s: s.get(key), store=store)
        return value.decode() if value else None

    # ---- the two operations every collective goes through ----------------------------------------------------------
    def check_run(self, items: list[tuple[str, int, str]], what: str, defer: bool = False) -> None:
        self._run = []

        def start() -> None:
            self._run = list(reversed(items))

        self.check("run", len(items), _crc(repr(items)), what, issue=start if defer else None)
        if not defer:
            start()

    def settle(self) -> None:
        """Verify the deferred header, then issue its payload (before anything else is issued on this channel)."""
        work, rows, seq, what, issue = self.deferred
        self.deferred = None
        self.wait(work, f"the check before {what} (collective #{seq})")
        self._verify(rows, seq, what)
        issue()

    def check(self, kind: str, numel: int, dtype, what: str, issue=None) -> None:
        """The header check of one collective; with ``issue``, deferred (see :func:`check_deferred`)."""
        if self.fatal is not None:
            raise self.fatal
        if self.deferred is not None:
            self.settle()  # collectives leave in the order they were asked for, on every rank
        if self._run:
            if self._run[-1] == (kind, int(numel), str(dtype)):
                self._run.pop()  # covered by the run's header: every rank issues this very collective now
                if issue is not None:
                    issue()
                return
            self._run = []
        seq = self.seq
        self.seq += 1
        dtype_code = dtype if isinstance(dtype, int) else _crc(str(dtype))  # a run: the hash of its items
        mine = [_KINDS[kind], int(numel), dtype_code, seq, _crc(what)]
        ring = shm_ring.existing(self.group)
        if ring is not None:  # ranks of one host: through the shared ring's header slots, no gloo round trip
            rows = torch.empty(self.world * 5, dtype=torch.int64)
            work = ring.exchange_header(seq, mine, rows, what, timeout_s())
        else:  # gloo, also beside NCCL (process_group.NCCL_WITH_GLOO): no GPU sync per header
            rows = torch.empty(self.world * 5, dtype=torch.int64, device=self.header_device)
            work = _all_gather(rows, torch.tensor(mine, dtype=torch.int64, device=self.header_device),
                               group=self.group, async_op=True)
        if issue is not None:
            self.deferred = (work, rows, seq, what, issue)
            return
        self.wait(work, f"the check before {what} (collective #{seq})")
        self._verify(rows, seq, what)

    def _verify(self, rows: torch.Tensor, seq: int, what: str) -> None:
        table = rows.view(self.world, 5).tolist()
        if all(r == table[self.rank] for r in table):
            return
        self._try(lambda s: s.set(self.prefix + f"div/{seq}/{self.rank}", what))
        descriptions = self._collect(f"div/{seq}/", lambda r: None)
        descriptions[self.rank] = what
        parts = []
        for r, row in enumerate(table):
            kind_name = _KIND_NAMES.get(row[0], "?")
            article = "an" if kind_name[0] in "aeiou" else "a"
            text = descriptions.get(r) or (f"a run of {row[1]} collectives" if kind_name == "run" else
                                           f"{article} {kind_name} of {row[1]} elements")
            parts.append(f"rank {self.global_ranks[r]}: {text}")
        same_shape = all(r[:3] == table[0][:3] for r in table)
        how = ("ranks ran different modules at the same point (layers in a different order, or a rank-dependent "
               "branch between same-size modules)" if same_shape else
               "ranks reached different collectives (a module, micro-batch or step that one rank ran and the "
               "other did not, or modules run in another order)")
        raise self.fail(DivergenceError(
            f"hf_zero: ranks diverged at collective #{seq}, before it was issued (seen on rank "
            f"{self.global_ranks[self.rank]}): {how}. " + "; ".join(parts) + ". Every rank must run the same "
            "modules, micro-batches and steps in the same order (generate(): synced_gpus=True)." + (
                " At ZeRO-3, a module whose ranks may use different parameters (mixture-of-experts routing, a "
                "branch chosen by rank) must be a leaf, whose gradients are reduced together with zeros for the "
                "unused ones: zero_optimization.leaf_module {\"names\": [...]} or "
                "deepspeed.utils.set_z3_leaf_modules(model, [ModuleClass])"
                if any(d and ("gradient reduce-scatter" in d or "the gather of module" in d)
                       for d in descriptions.values()) else "")))

    def wait(self, work, what: str, timeout: float | None = None, stream_ordered: bool = False) -> None:
        with self.bounded(what, timeout) as limit:
            if stream_ordered or self.backend == "nccl":
                # NCCL: the wait makes the current stream wait for the collective's, the host does not block (a
                # timeout argument would make it spin until the GPU is done). The group's own timeout (NCCL's
                # watchdog) and hf_zero's watchdog bound it.
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=limit))

    @contextlib.contextmanager
    def bounded(self, what: str, timeout: float | None = None):
        """Run a blocking collective call under the watchdog; its failure becomes the diagnosed fault. Issuing
        counts too: gloo's reduce-scatter blocks in the call itself, bounded only by the group's timeout."""
        if self.fatal is not None:
            raise self.fatal
        limit = timeout_s() if timeout is None else float(timeout)
        self.in_wait = (what, time.monotonic(), limit)
        try:
            yield limit
        except CommFault:
            raise
        except Exception as exc:
            if self.fatal is not None:
                raise self.fatal from exc
            raise self.fail(self.diagnose(what, limit, exc)) from exc
        finally:
            self.in_wait = None

    # ---- failing -----------------------------------------------------------------------------------------------------
    def fail(self, exc: CommFault) -> CommFault:
        """This rank's fault: publish it (the first fault of the job wins), exit non-zero when Python exits."""
        if self.fatal is None:
            self.fatal = exc
            self._try(lambda s: s.compare_set(self.prefix + "fault", "",
                                              f"rank {self.global_ranks[self.rank]}: {exc}"))
            self._try(lambda s: s.add(self.prefix + "seen", 1))
        self.raised = True
        _arm_exit()
        return exc

    def publish_exception(self, exc: BaseException) -> None:
        """An exception escaped the script on this rank (not a collective): make it the job's fault."""
        if self.fatal is not None:
            return
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        self.fail(PeerFailure(f"failed with {text}"))

    def _collect(self, sub: str, done) -> dict[int, str]:
        """Read ``prefix+sub+<rank>`` of every other rank, waiting at most the grace period."""
        deadline = time.monotonic() + self.grace()
        out: dict[int, str] = {}
        while time.monotonic() < deadline and len(out) < self.world - 1:
            for r in range(self.world):
                k = self.prefix + f"{sub}{r}"
                if r != self.rank and r not in out and self._try(lambda s: s.check([k]), default=False):
                    v = self._try(lambda s: s.get(k))
                    if v is not None:
                        out[r] = v.decode()
            time.sleep(0.02)
        return out

    def grace(self) -> float:
        return min(_GRACE_MAX_S, max(0.5, timeout_s() / 4))

    def diagnose(self, what: str, limit: float, exc: BaseException) -> CommFault:
        me = self.global_ranks[self.rank]
        first = self.published()
        if first is not None and not first.startswith(f"rank {me}:"):
            return PeerFailure(f"hf_zero: rank {me} stops because {first} (this rank was in {what})")
        closed = "closed" in str(exc).lower() or "reset" in str(exc).lower()
        how = "lost its connection to a peer" if closed else f"waited {limit:g}s"
        store_ok = self._try(lambda s: s.set(self.prefix + f"stuck/{self.rank}", what) or True, default=False)
        # ranks that are alive elsewhere post their main thread's stack (the watchdog, _answer_stack_request)
        self._try(lambda s: s.set(self.prefix + "stackreq", str(me)))
        if not store_ok:
            host = self.global_ranks[0]
            return PeerFailure(
                f"hf_zero: rank {me} {how} in {what}; the launcher's store (hosted by rank {host}'s process "
                f"unless torchrun's agent hosts it) does not answer either: rank {host} died or is stopped"
                + self._suspended_note())
        reports = self._collect("stuck/", None)
        first = self.published()
        if first is not None and not first.startswith(f"rank {me}:"):
            return PeerFailure(f"hf_zero: rank {me} stops because {first} (this rank was in {what})")
        lines, stacks = [f"rank {me} {how} in {what}"], []
        for r in range(self.world):
            if r == self.rank:
                continue
            if r in reports:
                lines.append(f"rank {self.global_ranks[r]} is alive and was blocked in {reports[r]}")
                continue
            where = self._whereabouts(r)
            lines.append(f"rank {self.global_ranks[r]} {where}")
            if where.startswith("is alive"):  # its watchdog answered the stack request during the grace period
                stack = self._try(lambda s: s.get(self.prefix + f"stack/{r}")
                                  if s.check([self.prefix + f"stack/{r}"]) else None)
                if stack:
                    stacks.append(f"\nrank {self.global_ranks[r]}'s main thread (innermost last):\n"
                                  f"{stack.decode()}")
        return PeerFailure("hf_zero: a collective could not complete: " + "; ".join(lines) +
                           ". comms_timeout_s bounds every hf_zero collective; raise it only if a rank is "
                           "legitimately slower." + self._suspended_note() + "".join(stacks))

    def _whereabouts(self, r: int) -> str:
        proc = self._try(lambda s: s.get(self.prefix + f"proc/{r}"))
        host, pid = (proc.decode().split() if proc else ("?", "0"))
        if host == self.hostname:
            state = _proc_state(int(pid))
            if state is None or state == "Z":
                return f"died (pid {pid} is gone)"
            if state in ("T", "t"):
                return f"is stopped (pid {pid} is suspended, e.g. SIGSTOP or a debugger) and stopped answering"
        hb = self._try(lambda s: s.get(self.prefix + f"hb/{r}"))
        if hb is None:
            return "never sent a heartbeat (died or stopped before its first collective)"
        age = time.time() - float(hb.decode())
        if age > 3 * self._period + 1.0:
            return f"stopped answering (no heartbeat for {age:.1f}s: died, stopped or hung) on host {host}"
        return (f"is alive (pid {pid} on {host}) but never reached this collective: it is running other code "
                f"(a different path through the model, or work outside hf_zero)")

    def _suspended_note(self) -> str:
        if self.suspended_s > 0:
            return (f" (note: this process itself was suspended for {self.suspended_s:.1f}s, e.g. by SIGSTOP; the "
                    f"other ranks gave up on it)")
        return ""

    # ---- the thread ----------------------------------------------------------------------------------------------
    def _monitor(self) -> None:
        last = time.monotonic()
        foreign: tuple[str, float] | None = None  # (another rank's published fault, when this thread first read it)
        store_lost_since: float | None = None
        me = self.global_ranks[self.rank]
        while not self._stop.wait(self._period):
            now = time.monotonic()
            if now - last > max(2.0, 10 * self._period):
                self.suspended_s += now - last - self._period
            last = now
            beat = self._try(lambda s: s.set(self.prefix + f"hb/{self.rank}", repr(time.time())) or True,
                             store=self._mon_store, default=False)
            store_lost_since = None if beat else (store_lost_since or now)
            self._answer_stack_request()
            if self._watch(now):
                continue
            if self.raised:
                continue
            inw = self.in_wait
            first = self.published(store=self._mon_store)
            if first is not None and not first.startswith(f"rank {me}:") and foreign is None:
                foreign = (first, now)
            if foreign is not None:
                # in a collective: that wait can never finish, go now; named as the rank that never came: go now
                # (its stack is in the message); elsewhere, give this rank's own code the grace period to fail by
                # itself -- the fault is remembered, since the store's host may be gone by then
                named = f"rank {me} is alive" in foreign[0]
                if inw is not None or named or now - foreign[1] > self.grace():
                    self._try(lambda s: s.add(self.prefix + "seen", 1), store=self._mon_store)
                    where = (f" (this rank was in {inw[0]})" if inw else
                             "" if f"rank {me}'s main thread" in foreign[0] else self._own_stack_note())
                    _die(f"hf_zero: rank {me} stops because {foreign[0]}{where}{self._suspended_note()}")
                continue
            if store_lost_since is not None and inw is None and now - store_lost_since > timeout_s() + self.grace():
                # not in a collective (whose own wait would name the cause) and no heartbeat could be written for
                # longer than any collective may wait: the store's host is gone, and no peer can reach this rank
                host = self.global_ranks[0]
                _die(f"hf_zero: rank {me} stops: the launcher's store (hosted by rank {host}'s process unless "
                     f"torchrun's agent hosts it) has not answered for {now - store_lost_since:.1f}s: rank {host} "
                     f"died or is stopped{self._own_stack_note()}{self._suspended_note()}")
            if inw is not None and now - inw[1] > inw[2] + self.grace():
                # the wait ignored its timeout (gloo in places): diagnose from here and end the process
                exc = self.diagnose(inw[0], inw[2], TimeoutError("the wait did not return"))
                self.fail(exc)
                _die(str(exc))

    def _answer_stack_request(self) -> None:
        """A waiting rank asked where every rank is (diagnose): post this process's main-thread stack, once."""
        if self._stack_sent:
            return
        key = self.prefix + "stackreq"
        if self._try(lambda s: s.check([key]), store=self._mon_store, default=False):
            self._stack_sent = True
            stack = _main_thread_stack()
            self._try(lambda s: s.set(self.prefix + f"stack/{self.rank}", stack), store=self._mon_store)

    def _own_stack_note(self) -> str:
        """Where this rank's main thread is while it is not in an hf_zero collective (it ran other code)."""
        stack = _main_thread_stack()
        return f"; this rank was not in a collective, its main thread (innermost last):\n{stack}" if stack else ""

    @contextlib.contextmanager
    def watch(self, what: str, interrupt):
        """Watch a span of code whose blocking calls hf_zero does not issue (torch.distributed.pipelining's sends
        and receives): while it runs, a fault published by another rank, or a peer whose heartbeat is older than
        comms_timeout_s (stopped, or hung), calls ``interrupt(message)`` from the monitor thread -- the caller ends
        its blocked calls and raises -- and if the span has not ended ``grace`` seconds later, the process ends
        here, printing the message, as for a wait that ignored its timeout."""
        self.watching, self._interrupted = (what, interrupt, time.monotonic()), None
        try:
            yield
        finally:
            self.watching = None

    def _watch(self, now: float) -> bool:
        """The monitor's part of :meth:`watch`; True when it has dealt with this period."""
        w = self.watching
        if w is None:
            return False
        what, interrupt, since = w
        if self._interrupted is not None:
            message, at = self._interrupted
            if now - at > self.grace():
                _die(message)
            return True
        me = self.global_ranks[self.rank]
        first = self.published(store=self._mon_store)
        message = None
        if first is not None and not first.startswith(f"rank {me}:"):
            self._try(lambda s: s.add(self.prefix + "seen", 1), store=self._mon_store)
            message = f"hf_zero: rank {me} stops because {first} (this rank was in {what})"
            self.fail(PeerFailure(message))
        elif self.fatal is None and now - since > timeout_s() and self._silent_peers():
            exc = self.diagnose(what, timeout_s(), TimeoutError("no progress"))
            message = str(exc)
            self.fail(exc)
        if message is None:
            return True
        self._interrupted = (message + self._suspended_note(), now)
        interrupt(message)
        return True

    def _silent_peers(self) -> list[int]:
        """Peers whose last heartbeat is older than comms_timeout_s (stopped, hung, or gone)."""
        out = []
        for r in range(self.world):
            if r == self.rank:
                continue
            key = self.prefix + f"hb/{r}"
            # check first: a get of a key nobody wrote blocks for the store's whole I/O timeout, every period, and
            # a peer that never heartbeated here (stopped before its channel's first beat, or never using this
            # group) has nothing to show it is alive -- the caller asks only once it has waited comms_timeout_s,
            # and diagnose() then names what the peer's process really is doing
            if not self._try(lambda s: s.check([key]), store=self._mon_store, default=False):
                out.append(r)
                continue
            hb = self._try(lambda s: s.get(key), store=self._mon_store)
            if hb is not None and time.time() - float(hb.decode()) > timeout_s():
                out.append(r)
        return out

    def close(self) -> None:
        """Stop the monitor and wait for it (GroupComm.close): a daemon thread still inside a store call when the
        interpreter finalizes is ended by pthread_exit as it takes the GIL back, and that unwinding through C++
        frames aborts the process ('terminate called without an active exception'). The thread checks its stop
        flag between store calls, each bounded by the store's I/O timeout, so the join is bounded too."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=3 * self._io_timeout_s + 2 * self._period)
            if self._thread.is_alive():
                logger.warning("hf_zero: the fault monitor of ranks %s did not stop within %.1fs (a store call "
                               "blocked); the process may abort at exit", self.global_ranks,
                               3 * self._io_timeout_s + 2 * self._period)
        self.group = None

    def wait_for_peers_to_read(self) -> None:
        """Before this process exits: the store may live in it (rank 0); let the other ranks read the fault."""
        if self.fatal is None:
            return
        deadline = time.monotonic() + self.grace()
        while time.monotonic() < deadline:
            seen = self._try(lambda s: s.add(self.prefix + "seen", 0), default=self.world)
            if seen >= self.world:
                return
            time.sleep(0.05)


# ---- process exit --------------------------------------------------------------------------------------------------
_exit_armed = False
_hooks_installed = False


def _die(message: str) -> None:
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        shm_ring.unlink_pending()  # a ring set-up this exit interrupts leaves no named file behind
        for ch in _channels():
            ch.wait_for_peers_to_read()
        os._exit(1)


def _exit_now() -> None:
    """atexit: a process group with work in flight (gloo) blocks interpreter shutdown forever; leave first."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        shm_ring.unlink_pending()  # a ring set-up this exit interrupts leaves no named file behind
        for ch in _channels():
            ch.wait_for_peers_to_read()
        os._exit(1)


def _arm_exit() -> None:
    global _exit_armed
    if not _exit_armed:
        _exit_armed = True
        atexit.register(_exit_now)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    previous = sys.excepthook

    def hook(tp, value, tb):
        channels = _channels()
        for ch in channels:
            ch.publish_exception(value)
        if any(ch.fatal is not None for ch in channels):
            # this process ends with status 1 (the atexit os._exit); bound the way there as well
            _exit_within(3 * max(ch.grace() for ch in channels) + 1.0)
        previous(tp, value, tb)

    sys.excepthook = hook


def _exit_within(seconds: float) -> None:
    """A daemon timer ending the process with status 1 after ``seconds``, should the shutdown of a process that
    already failed stall (a CI run once saw a continued SIGSTOPped pipeline rank print its error and never exit)."""
    def force() -> None:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"hf_zero: the exit after the failure above took over {seconds:g}s; ending the "
                             "process now\n")
            sys.stderr.flush()
            sys.stdout.flush()
        os._exit(1)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()
