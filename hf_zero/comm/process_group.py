"""Process-group start-up and the small DeepSpeed-style functional API (``deepspeed.comm`` forwards here).

hf_zero never invents a transport: this is torch.distributed, initialized from the variables torchrun and
accelerate launch set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Without them, a plain
``python train.py`` gets a world of one, so the same script runs with and without a launcher.

A leaf of comm: it reads settings.py (the default bound), device.py (where this process trains) and comms_log.py
(the comms logger times the functional collectives) and nothing else; what hf_zero keeps per group is closed
through :func:`before_destroy` hooks that context.py registers.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from . import settings
from .comms_log import timed_op
from .settings import created_by_hf_zero

__all__ = ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "get_node_id",
           "default_backend", "backend_for", "bookkeeping_device", "free_port", "created_by_hf_zero", "before_destroy",
           "quiesce_gloo_workers", "all_reduce", "broadcast", "all_gather", "ReduceOp"]

ReduceOp = dist.ReduceOp
logger = logging.getLogger("hf_zero")


def default_backend() -> str:
    """NCCL when this process trains on a GPU (see device.py), gloo otherwise."""
    from .device import accelerator_type

    return "nccl" if accelerator_type() == "cuda" and dist.is_nccl_available() else "gloo"


# What init_distributed asks for when the backend is NCCL: NCCL for CUDA tensors and gloo beside it for CPU tensors,
# in one process group (torch dispatches each collective by its tensors' device). hf_zero's small bookkeeping
# collectives -- the divergence headers, barriers, flags -- stay on the CPU, where a GPU round trip would cost a
# host synchronisation each; with plain NCCL they could not run at all.
NCCL_WITH_GLOO = "cuda:nccl,cpu:gloo"  # the spelling accelerate uses for the same pair


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for MASTER_PORT of a local world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialize the default process group once; a no-op when it already is.

    Same signature as ``deepspeed.init_distributed``. ``auto_mpi_discovery`` and ``config`` are accepted and
    unused: hf_zero reads the launcher's environment variables only.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        return
    env_rank = os.environ.get("RANK")
    env_world = os.environ.get("WORLD_SIZE")
    if rank < 0:
        rank = int(env_rank) if env_rank is not None else 0
    if world_size < 0:
        world_size = int(env_world) if env_world is not None else 1
    if env_rank is None and env_world is None and world_size == 1 and init_method is None:
        # Not launched by torchrun/accelerate: a world of one on loopback, so single-process scripts just work.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    elif "MASTER_ADDR" not in os.environ and init_method is None:
        raise RuntimeError(
            f"hf_zero: RANK={env_rank} WORLD_SIZE={env_world} are set but MASTER_ADDR is not; launch with torchrun "
            "or accelerate launch, or set MASTER_ADDR and MASTER_PORT")
    else:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or default_backend()
    if backend == "nccl":
        from .device import local_device

        local_device()  # cuda:LOCAL_RANK made current before NCCL picks its device
        backend = NCCL_WITH_GLOO
    # hf_zero's bound (comms_timeout_s / DEEPSPEED_TIMEOUT, default 300 s), not torch's 30 minutes; the engine
    # re-applies the config's value once it is read
    kwargs = {"backend": backend, "rank": rank, "world_size": world_size,
              "timeout": timeout if timeout is not None else datetime.timedelta(seconds=settings.timeout_s())}
    if init_method is not None:
        kwargs["init_method"] = init_method
    dist.init_process_group(**kwargs)
    settings.mark_created_by_hf_zero()
    atexit.register(_destroy_at_exit)


_BEFORE_DESTROY: list = []


def before_destroy(hook) -> None:
    """``hook()`` runs before the exit handler destroys the group hf_zero created (context.py closes every group's
    state there: the fault monitors joined, the rings and their group references dropped), whichever exit handler
    was registered first."""
    if hook not in _BEFORE_DESTROY:
        _BEFORE_DESTROY.append(hook)


def _destroy_at_exit() -> None:
    """atexit, normal exit of a script whose process group hf_zero created: tear the group down while the
    interpreter still runs (DeepSpeed scripts never call destroy_process_group themselves), then let gloo's worker
    threads finish with the GIL (:func:`quiesce_gloo_workers`). A fault exit never gets here: it leaves with
    os._exit."""
    for hook in _BEFORE_DESTROY:
        try:
            hook()
        except Exception:  # exiting anyway; a failure here must not turn a finished run into an error
            pass
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # exiting anyway; a failure here must not turn a finished run into an error
            pass
    quiesce_gloo_workers()


# The name torch gives ProcessGroupGloo's worker threads (c10::setThreadName in its constructor).
_GLOO_WORKER = "pt_gloo_runloop"


def _gloo_worker_states() -> dict[str, tuple[str, int]]:
    """thread id -> (scheduler state, context switches so far) of this process's gloo worker threads, from /proc
    (empty where there is none, or no /proc)."""
    out: dict[str, tuple[str, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # the thread ended meanwhile
            continue
        switches = int(fields.get("voluntary_ctxt_switches", "0")) + int(fields.get("nonvoluntary_ctxt_switches", "0"))
        out[tid] = (fields.get("State", "?").split()[0], switches)
    return out


def quiesce_gloo_workers(timeout_s: float = 2.0) -> bool:
    """At exit, before the interpreter finalizes: wait, with the GIL released, until every gloo worker thread of
    this process is asleep and stays asleep. Returns False if they did not within ``timeout_s``.

    Why (docs/reliability.md, the exit abort): ``destroy_process_group`` does not stop gloo's threads while anything
    still references the group -- the engine, its optimizer, the sequence-parallel groups do, until interpreter
    teardown. A worker that finishes a collective frees its tensors, and a tensor whose Python object was dropped
    first (a temporary passed to ``all_gather``) takes the GIL to free that object. If the worker was descheduled
    and asks for the GIL only once the interpreter finalizes, CPython ends it with ``pthread_exit``; the unwind
    meets the tensor's noexcept destructor and ``std::terminate`` aborts the process ('terminate called without an
    active exception', exit -6) after the run succeeded.

    The check: every worker in state S with its context-switch count unchanged across a sleep of twice the
    interpreter's switch interval (10 to 100 ms). A worker waiting for the GIL is woken when the sleep releases it
    (and by its own timed wait every switch interval), so it cannot look unchanged; one still running, or
    descheduled, is in state R. A
    worker asleep through the whole sleep waits for work (or for a peer that never comes) and frees nothing until
    woken; in a finished run nothing wakes it again."""
    before = _gloo_worker_states()
    if not before:
        return True
    pause = min(0.1, max(0.01, 2 * sys.getswitchinterval()))
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(pause)  # the GIL released: a worker waiting for it takes it now
        now = _gloo_worker_states()
        if now == before and all(state == "S" for state, _ in now.values()):
            return True
        if time.monotonic() > deadline:
            logger.debug("hf_zero: gloo worker threads still active at exit after %.1fs: %s", timeout_s, now)
            return False
        before = now


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_node_id() -> str:
    """Which node this process runs on, as node-local things (checkpoint directories) are grouped: the host name,
    plus torchrun's ``GROUP_RANK`` (its agent's rank: one per node) when set -- so two launchers on one machine are
    two nodes, as their private directories make them."""
    group_rank = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"#{group_rank}" if group_rank is not None else "")


def backend_for(device_type: str, group=None) -> str:
    """The backend that runs ``group``'s collectives on ``device_type`` tensors ("gloo", "nccl", ...; "" if none).
    ``dist.get_backend`` names a group's backends as one string ("cuda:nccl,cpu:gloo" for hf_zero's NCCL groups),
    so asking it whether "gloo" is in there says nothing about which one a CUDA tensor meets."""
    try:
        config = str(dist.get_backend_config(group))  # "cpu:gloo,cuda:gloo" for "gloo", "cuda:nccl" for "nccl"
    except (ValueError, KeyError, AssertionError, TypeError):  # a group torch registered no config for
        config = str(dist.get_backend(group))
    for item in config.split(","):
        device, _, backend = item.strip().partition(":")
        if not backend:  # a bare name serves every device
            return device
        if device == device_type:
            return backend
    return ""


def bookkeeping_device(group=None) -> torch.device:
    """Where hf_zero's small bookkeeping collectives (divergence headers, flags, barriers) put their tensors for
    ``group``: the CPU where the group has gloo (hf_zero's own NCCL groups have it beside NCCL), else -- a plain
    NCCL group the application created -- the current GPU, the only device NCCL takes."""
    if backend_for("cpu", group) == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# DeepSpeed's signatures: ``prof`` asks the comms logger to time this call, ``log_name`` files it, ``debug`` is
# accepted (the logger's own ``debug`` switch adds the caller).

@timed_op("tensor")
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@timed_op("tensor")
def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


@timed_op("tensor")
def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
