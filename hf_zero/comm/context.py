"""Where a process group's communication state lives: one :class:`GroupComm` per group, closed with the group.

hf_zero keeps three things per process group: the fault channel (faults.py: store clients, the collective sequence,
a monitor thread), the shared-memory ring (shm_ring.py: a mapping of every rank's memory) and ZeRO-3's gatherer
(zero/stage3/gather.py: gather statistics and labels). They used to live in three module-level dicts with three
key schemes (group ranks, object id plus a pinned group, the group object) and were never torn down: a ring's pin
kept the default ProcessGroup -- and gloo's threads -- alive after ``destroy_process_group``.

Now each is a slot of the group's GroupComm, keyed by the ProcessGroup object (``None`` means the default group,
resolved to it). A GroupComm lives as long as its group: :meth:`GroupComm.close` -- settle the deferred check,
stop and join the fault monitor, drop the ring's mapping and the gatherer -- runs

- from :func:`destroy_process_group` (hf_zero's, which ``deepspeed.comm.destroy_process_group`` is) before the
  group itself is destroyed;
- from process_group's destroy hook, which its exit handler runs before it destroys the group hf_zero created;
- at interpreter exit (atexit) for any context still open -- then, where the application created the group,
  gloo's workers are let finish with the GIL before teardown (process_group.quiesce_gloo_workers);
- lazily, for a group destroyed directly with ``torch.distributed.destroy_process_group``: the next lookup that
  misses finds contexts whose group is gone and closes them.

States: OPEN -> CLOSED, once; a closed context is out of the registry, and the next use of the group (a new group
object after re-initialisation) gets a fresh one. This module holds the slots only; it never builds a channel or a
ring (faults.py and shm_ring.py do, through :func:`get`), so it imports nothing but process_group.
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading

import torch.distributed as dist

from . import process_group

__all__ = ["GroupComm", "State", "get", "lookup", "contexts", "close", "close_all", "destroy_process_group"]

logger = logging.getLogger("hf_zero")


class State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class GroupComm:
    """The communication state of one process group. Slots are filled on first use by their owners:
    ``channel`` (faults.FaultChannel or None), ``ring`` (shm_ring.ShmRing, or None where the group has none; the
    slot is absent until the ring was decided, see ``ring_decided``), and named ``attachments`` (the gatherer)."""

    def __init__(self, pg, ranks: tuple[int, ...], incarnation: int, key: str = "") -> None:
        self.pg = pg                    # the ProcessGroup object (the default group's, for None)
        self.ranks = ranks              # global ranks, in group order
        self.key = key or "-".join(map(str, ranks))  # names this group alike on every rank (see group_key)
        self.incarnation = incarnation  # how many earlier contexts had this key (a re-created world): the fault
        #                                 channel's store keys include it, so a new world never reads an old fault
        self.channel = None
        self.ring = None
        self.ring_decided = False
        self.attachments: dict[str, object] = {}
        self.state = State.OPEN

    def attachment(self, name: str, factory):
        """The attachment ``name``, built by ``factory()`` on first use."""
        value = self.attachments.get(name)
        if value is None:
            value = self.attachments[name] = factory()
        return value

    def settle(self) -> None:
        """Issue the payload of a deferred check still waiting (every rank closes at the same point)."""
        ch = self.channel
        if ch is not None and ch.deferred is not None and ch.fatal is None:
            ch.settle()

    def close(self, *, settle: bool = True) -> None:
        """Settle the deferred check (``settle``: the group is still usable), stop and join the fault monitor, drop
        the ring and the attachments. After it the context holds no reference to the group."""
        assert self.state is State.OPEN, self.state
        try:
            if settle:
                try:
                    self.settle()
                except Exception as exc:  # a failed settle is a fault already published; closing goes on
                    logger.warning("hf_zero: settling the deferred check of ranks %s failed while closing: %s",
                                   list(self.ranks), exc)
        finally:
            self.state = State.CLOSED
            if self.channel is not None:
                self.channel.close()
            if self.ring is not None:
                self.ring.close()
            for value in self.attachments.values():
                close = getattr(value, "close", None)
                if close is not None:
                    close()
            self.attachments.clear()
            self.channel = self.ring = self.pg = None


_CONTEXTS: dict = {}        # ProcessGroup -> GroupComm
_INCARNATIONS: dict = {}    # group_key -> contexts created for it so far
_lock = threading.RLock()
_hooks_installed = False


def _resolve(group):
    return dist.group.WORLD if group is None else group


def _alive(pg) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if pg is dist.group.WORLD:
        return True
    try:
        dist.get_process_group_ranks(pg)
        return True
    except (KeyError, ValueError, RuntimeError):
        return False


def lookup(group=None) -> GroupComm | None:
    """The open context of ``group`` if there is one (no creation; cheap: one dict look-up)."""
    if not _CONTEXTS:
        return None
    return _CONTEXTS.get(_resolve(group))


def get(group=None) -> GroupComm:
    """The context of ``group`` (None: the default group), created on first use. The group must be initialized."""
    pg = _resolve(group)
    ctx = _CONTEXTS.get(pg)
    if ctx is not None:
        return ctx
    with _lock:
        ctx = _CONTEXTS.get(pg)
        if ctx is not None:
            return ctx
        _close_stale()
        _install_hooks()
        ranks = tuple(dist.get_process_group_ranks(pg))
        key = group_key(pg, ranks)
        incarnation = _INCARNATIONS.get(key, 0)
        _INCARNATIONS[key] = incarnation + 1
        ctx = _CONTEXTS[pg] = GroupComm(pg, ranks, incarnation, key)
        return ctx


def group_key(pg, ranks: tuple[int, ...]) -> str:
    """A name for ``pg`` that every rank of it computes alike, whatever order each rank first used its groups in.
    Not the ranks alone: two groups can have the same ranks (a 2-stage pipeline's own group and the default group,
    or the pipeline group and a tied-weight group), and counting incarnations per rank list then depended on which
    a rank touched first -- rank 0 and rank 1 wrote heartbeats under different keys and a stopped peer was never
    seen. torch's group name is given in creation order, which is the same on every rank (new_group is collective),
    and restarts with a re-created world (hence the incarnation)."""
    if pg is dist.group.WORLD:
        return "world"
    name = getattr(pg, "group_name", None)
    return f"{name}:" + "-".join(map(str, ranks)) if name else "-".join(map(str, ranks))


def contexts() -> list[GroupComm]:
    return list(_CONTEXTS.values())


def _close_stale() -> None:
    # a group destroyed by torch.distributed.destroy_process_group directly (not through hf_zero): its context is
    # found here, at the next creation, and closed without settling (the group can no longer carry anything)
    for pg, ctx in list(_CONTEXTS.items()):
        if not _alive(pg):
            _CONTEXTS.pop(pg, None)
            ctx.close(settle=False)


def close(group=None) -> None:
    """Close the context of ``group`` if it has one (see :meth:`GroupComm.close`)."""
    with _lock:
        ctx = _CONTEXTS.pop(_resolve(group), None)
    if ctx is not None:
        ctx.close(settle=_alive(_resolve(group)))


def close_all() -> None:
    """Close every open context: subgroups first, the default group's last (settling may use it)."""
    with _lock:
        items = list(_CONTEXTS.items())
        _CONTEXTS.clear()
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    items.sort(key=lambda item: item[0] is world)
    errors = []
    for pg, ctx in items:
        try:
            ctx.close(settle=_alive(pg))
        except Exception as exc:  # close the others; report the first
            errors.append(exc)
    if errors:
        raise errors[0]


def destroy_process_group(group=None) -> None:
    """``torch.distributed.destroy_process_group`` after closing hf_zero's state for it: for the default group (or
    None) every context, as torch destroys every group with it; for a subgroup, that group's."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if group is None or group is dist.group.WORLD:
        close_all()
    else:
        close(group)
    dist.destroy_process_group(group)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    # process_group destroys the group hf_zero created at exit; it runs this first, whatever the order the exit
    # handlers were registered in (a second init_distributed registers its handler after this module's)
    process_group.before_destroy(close_all)
    atexit.register(_close_all_at_exit)


def _close_all_at_exit() -> None:
    """atexit: close every context still open. Where hf_zero created the group, process_group's exit handler runs
    after this one (registered first), destroys the group and quiesces gloo's workers; otherwise that is done here,
    as the group is left to the application (docs/reliability.md, the exit abort)."""
    try:
        close_all()
    finally:
        if not process_group.created_by_hf_zero():
            process_group.quiesce_gloo_workers()
