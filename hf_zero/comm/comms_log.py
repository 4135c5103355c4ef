"""DeepSpeed's comms logger (the ``comms_logger`` config section, ``deepspeed.comm.configure`` / ``log_summary``):
every profiled collective's name, message size, latency and bandwidths, kept per op and per message size.

One process-wide :data:`logger` owns the records. Two kinds of call site feed it, and both cost one bool check
(``logger.enabled``) when it is off:

* hf_zero's bounded collectives (collectives.py): ``_issue`` starts a :class:`Timing` when the payload leaves and
  the ``wait()`` of the payload's handle stops it (:class:`TimedWork`), because several of them move their data
  only inside ``wait()`` (the shared ring) or deliver into buffers the caller prepares between issue and wait. The latency of an overlapped
  (asynchronous) collective is therefore issue-to-completion as its waiter saw it, an upper bound on the transfer.
* the DeepSpeed-signature functions (process_group.py, integrations/ds_comm.py), through :func:`timed_op`: a
  synchronous call is timed to its return, an asynchronous one to the ``wait()`` of the handle it returns.

On CUDA the device is synchronized before each clock read, so queued kernels are not counted and the collective's
kernels are. hf_zero's divergence check (a small all-gather before each bounded collective, faults.py) is not logged.

Units as DeepSpeed's: latency in ms, bandwidth in Gbps (1e9 bits/s), message size in bytes -- the bytes this rank
puts in (an all-gather's shard, a reduce-scatter's whole input). Bandwidths follow nccl-tests' definitions
(``doc/PERFORMANCE.md``): ``algbw = S / t`` with ``S`` the collective's size (``world_size`` shards for an
all-gather, the message otherwise) and ``busbw = algbw * factor`` (:func:`busbw_factor`), ``n`` being the size of
the collective's group. DeepSpeed differs (docs/deepspeed_names.md): its all-reduce ``algbw`` is doubled, its
reduce-scatter ``S`` is ``world_size`` inputs, and its ``n`` is always the global world size.

A leaf of comm: imports torch only; the straggler analysis's bounded all-reduce is handed in (use_collectives).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CommsLogger", "Timing", "TimedWork", "logger", "configure", "configure_from", "timed_op", "busbw_factor",
           "bandwidths_gbps", "calc_bw_log", "convert_size", "get_caller_func", "trimmed_mean"]

_log = logging.getLogger("hf_zero")

# Op name -> how its bytes cross the wire. Names are DeepSpeed's functions and log names, and the kinds of hf_zero's
# own collectives (collectives.py). Anything else moves its message once: factor 1.
_FAMILY = {
    **dict.fromkeys(("all_reduce", "all_reduce_coalesced", "inference_all_reduce"), "all_reduce"),
    **dict.fromkeys(("all_gather", "all_gather_into_tensor", "allgather_fn", "all_gather_coalesced"), "all_gather"),
    **dict.fromkeys(("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn", "reduce_scatter_coalesced"),
                    "reduce_scatter"),
    **dict.fromkeys(("all_to_all", "all_to_all_single"), "all_to_all"),
}

# A DeepSpeed name in prof_ops also selects hf_zero's own collective of that kind (a DeepSpeed config that profiles
# "all_gather_into_tensor" profiles ZeRO-3's gathers here too).
_HF_ZERO_KIND = {"all_gather_into_tensor": "all_gather", "allgather_fn": "all_gather",
                 "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_fn": "reduce_scatter"}

# Frames of comm are the collectives' machinery, not the caller that ``debug`` names. (A timed_op function's own
# frame is never on the stack when it is timed: the wrapper starts the timing first; its caller is named, as
# DeepSpeed names it.)
_COMM_PACKAGE = __name__.rpartition(".")[0] + "."

_TRIM = 0.1  # averages drop this share of the samples at each end (outliers: the first call, a preempted one)


def busbw_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` on ``world_size`` ranks (nccl-tests): the share of the data each rank's link
    carries. All-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; anything else 1."""
    family = _FAMILY.get(op)
    n = world_size
    if family == "all_reduce":
        return 2 * (n - 1) / n
    if family is not None:
        return (n - 1) / n
    return 1.0


def bandwidths_gbps(op: str, msg_nbytes: int, latency_ms: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in Gbps of one ``op`` that took ``latency_ms`` with a ``msg_nbytes`` message (the bytes one
    rank puts in). An all-gather's size is ``world_size`` messages; every other op's is the message."""
    if latency_ms <= 0:
        return 0.0, 0.0
    size_nbytes = msg_nbytes * world_size if _FAMILY.get(op) == "all_gather" else msg_nbytes
    algbw = size_nbytes * 8 / (latency_ms * 1e-3) / 1e9
    return algbw, algbw * busbw_factor(op, world_size)


def calc_bw_log(comm_op: str, size: int, duration: float) -> tuple[float, float]:
    """DeepSpeed's name and arguments (``duration`` in ms, the world: the default group) for
    :func:`bandwidths_gbps`."""
    return bandwidths_gbps(comm_op, size, duration, _world_size(None))


def convert_size(size_bytes: int) -> str:
    """``4096`` -> ``"4.0 KB"`` (powers of 1024, two decimals at most), ``0`` -> ``"0B"``, as DeepSpeed prints it."""
    if size_bytes == 0:
        return "0B"
    units = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    power = 0
    while power < len(units) - 1 and size_bytes >= 1024 ** (power + 1):  # integers: no log() rounding at 1024**k
        power += 1
    return f"{round(size_bytes / 1024 ** power, 2)} {units[power]}"


def get_caller_func(frame: int = 3) -> str:
    """The name of the function ``frame`` frames up the stack (DeepSpeed's helper)."""
    return sys._getframe(frame).f_code.co_name


def trimmed_mean(values: Iterable[float], trim: float = _TRIM) -> float:
    """The mean of ``values`` without the lowest and highest ``trim`` share (rounded); 0 for no values."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = int(round(len(ordered) * trim))
    kept = ordered[k:len(ordered) - k] or ordered
    return sum(kept) / len(kept)


def _world_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _sync(device) -> None:
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _caller() -> str:
    """The function that asked for the collective: the first frame outside the logging and comm machinery."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_COMM_PACKAGE):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "<unknown>"


class Timing:
    """One profiled collective: :meth:`start` when it leaves, :meth:`stop` when it is complete (records it)."""

    __slots__ = ("log", "raw_name", "record_name", "msg_nbytes", "world_size", "device", "started_s")

    def __init__(self, log: "CommsLogger", raw_name: str, record_name: str, msg_nbytes: int, world_size: int,
                 device) -> None:
        self.log, self.raw_name, self.record_name = log, raw_name, record_name
        self.msg_nbytes, self.world_size, self.device = msg_nbytes, world_size, device
        self.started_s: float | None = None

    def start(self) -> None:
        _sync(self.device)
        self.started_s = self.log.clock()

    def stop(self) -> None:
        assert self.started_s is not None, f"comms logger: {self.record_name} stopped before it started"
        _sync(self.device)
        latency_ms = (self.log.clock() - self.started_s) * 1e3
        self.started_s = None
        self.log.append(self.raw_name, self.record_name, latency_ms, self.msg_nbytes, world_size=self.world_size)


class TimedWork:
    """The handle of a profiled asynchronous torch.distributed call: records it when ``wait()`` returns; every
    other attribute is the wrapped handle's."""

    def __init__(self, work, timing: Timing) -> None:
        self._work, self._timing = work, timing

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if self._timing is not None:
            timing, self._timing = self._timing, None
            timing.stop()
        return result

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class CommsLogger:
    """The records and the switches. ``comms_dict[record_name][msg_nbytes] = [count, latencies_ms, algbws_gbps,
    busbws_gbps]`` (DeepSpeed's layout: scripts read it). ``clock`` returns seconds (injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.comms_dict: dict[str, dict[int, list]] = {}
        self.enabled = False
        self.verbose = False
        self.debug = False
        self.prof_all = True
        self._prof_ops: list[str] = []
        self._selected: frozenset[str] = frozenset()
        self._lock = threading.Lock()  # collectives may be waited on from other threads (offload prefetch)
        self._quiet = threading.local()  # .active: this thread's collectives are the logger's own (not recorded)

    # ---- switches --------------------------------------------------------------------------------------------

    @property
    def prof_ops(self) -> list[str]:
        return list(self._prof_ops)

    @prof_ops.setter
    def prof_ops(self, ops: Iterable[str]) -> None:
        self._prof_ops = list(ops)
        self._selected = frozenset(self._prof_ops) | {_HF_ZERO_KIND[o] for o in self._prof_ops if o in _HF_ZERO_KIND}

    def set(self, *, enabled: bool | None = None, verbose: bool | None = None, prof_all: bool | None = None,
            prof_ops: Iterable[str] | None = None, debug: bool | None = None) -> None:
        """Change the switches that are not None."""
        if enabled is not None:
            self.enabled = bool(enabled)
        if verbose is not None:
            self.verbose = bool(verbose)
        if prof_all is not None:
            self.prof_all = bool(prof_all)
        if prof_ops is not None:
            self.prof_ops = prof_ops
        if debug is not None:
            self.debug = bool(debug)

    def configure(self, comms_config) -> None:
        """DeepSpeed's form: ``comms_config.comms_logger_enabled`` and its ``comms_logger`` section."""
        self.enabled = bool(comms_config.comms_logger_enabled)
        if self.enabled:
            section = comms_config.comms_logger
            self.set(verbose=section.verbose, prof_all=section.prof_all, prof_ops=section.prof_ops,
                     debug=section.debug)

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = list(dict.fromkeys([*self._prof_ops, *op_name_list]))

    def stop_profiling_op(self, op_name_list: Iterable[str]) -> None:
        dropped = set(op_name_list)
        self.prof_ops = [op for op in self._prof_ops if op not in dropped]

    def quiet(self):
        """``with logger.quiet():`` -- this thread's collectives are not recorded (the logger's own all-reduces)."""
        return _Quiet(self._quiet)

    def wants(self, log_name: str, prof: bool = False) -> bool:
        """Whether a collective logged as ``log_name`` is profiled (``prof``: the call asked for it)."""
        return bool(prof) or self.prof_all or log_name in self._selected

    def timing(self, raw_name: str, log_name: str, msg_nbytes: int, group=None, device=None,
               prof: bool = False) -> Timing | None:
        """A :class:`Timing` for a collective, not started; None when it is not profiled. Call only when enabled."""
        if not self.wants(log_name, prof) or getattr(self._quiet, "active", False):
            return None
        record_name = f"{log_name} | [Caller Func: {_caller()}]" if self.debug else log_name
        return Timing(self, raw_name, record_name, int(msg_nbytes), _world_size(group), device)

    # ---- records ---------------------------------------------------------------------------------------------

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int, *,
               world_size: int | None = None) -> None:
        """Record one ``raw_name`` collective (filed as ``record_name``) of ``msg_size`` bytes that took ``latency``
        ms; bandwidths over ``world_size`` ranks (default: the default group's)."""
        world = _world_size(None) if world_size is None else world_size
        algbw, busbw = bandwidths_gbps(raw_name, msg_size, latency, world)
        with self._lock:
            row = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
            row[0] += 1
            row[1].append(latency)
            row[2].append(algbw)
            row[3].append(busbw)
        if self.verbose and _rank() == 0:
            _log.info("hf_zero comms: %s, %s in %.3f ms, algbw %.2f Gbps, busbw %.2f Gbps", record_name,
                      convert_size(msg_size), latency, algbw, busbw)

    def _snapshot(self) -> dict[str, dict[int, list]]:
        with self._lock:
            return {name: {size: [row[0], list(row[1]), list(row[2]), list(row[3])] for size, row in rows.items()}
                    for name, rows in self.comms_dict.items()}

    def get_raw_data(self) -> dict[str, dict[int, list]]:
        return self._snapshot()

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        with self._lock:
            self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(row[0] for rows in self._snapshot().values() for row in rows.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        rows = self._snapshot().get(operation_name)
        return None if rows is None else {size: _summary_row(size, row) for size, row in sorted(rows.items())}

    def log_all(self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False):
        """Print (``print_log``) the table of every op and message size; return it as a dict with ``return_dict``:
        ``{"summary": {op: {msg_nbytes: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps, busbw_avg_gbps,
        msg_size_bytes, msg_size_str}}}, "straggler_analysis": ... or None, "metadata": {world_size, rank,
        timestamp}}``. ``show_straggler`` is collective (every rank must call it, having recorded the same ops): it
        splits each latency into the fastest rank's and the wait for the slowest."""
        records = self._snapshot()
        summary = {name: {size: _summary_row(size, row) for size, row in sorted(rows.items())}
                   for name, rows in records.items()}
        lines = []
        if print_log:
            lines.append(_table_line("op", "message size", "count", "total lat (ms)", "avg lat (ms)",
                                     "algbw avg (Gbps)", "busbw avg (Gbps)"))
            for name, rows in summary.items():
                lines.append(name)
                lines += [_table_line("", r["msg_size_str"], r["count"], f"{r['total_latency_ms']:.2f}",
                                      f"{r['avg_latency_ms']:.2f}", f"{r['tput_avg_gbps']:.2f}",
                                      f"{r['busbw_avg_gbps']:.2f}") for r in rows.values()]
        stragglers = _straggler_analysis(records) if show_straggler else None
        if print_log and stragglers is not None:
            lines.append("the same, split into the fastest rank's latency and the wait for the slowest:")
            lines.append(_table_line("op", "message size", "count", "total lat (ms)", "total wait (ms)",
                                     "avg lat (ms)", "avg wait (ms)"))
            for name, rows in stragglers.items():
                lines.append(name)
                lines += [_table_line("", r["msg_size_str"], r["count"], f"{r['total_comm_lat_ms']:.2f}",
                                      f"{r['total_straggler_ms']:.2f}", f"{r['avg_comm_lat_ms']:.2f}",
                                      f"{r['avg_straggler_ms']:.2f}") for r in rows.values()]
        if lines:
            print("\n".join(lines), flush=True)
        if not return_dict:
            return None
        return {"summary": summary, "straggler_analysis": stragglers,
                "metadata": {"world_size": _world_size(None), "rank": _rank(),
                             "timestamp": datetime.datetime.now().isoformat()}}


def _table_line(*cells) -> str:
    return "".join(f"{str(c):<20}" for c in cells).rstrip()


def _summary_row(msg_nbytes: int, row: list) -> dict[str, Any]:
    count, latencies, algbws, busbws = row
    return {"count": count, "total_latency_ms": sum(latencies), "avg_latency_ms": trimmed_mean(latencies),
            "tput_avg_gbps": trimmed_mean(algbws), "busbw_avg_gbps": trimmed_mean(busbws),
            "msg_size_bytes": msg_nbytes, "msg_size_str": convert_size(msg_nbytes)}


class _Quiet:
    def __init__(self, state: threading.local):
        self.state = state

    def __enter__(self):
        self.state.active = True

    def __exit__(self, *exc):
        self.state.active = False


# The bounded all-reduce and the bookkeeping device the straggler analysis runs on. comms_log is a leaf of comm (the
# collectives import it to record themselves), so the package hands them in (hf_zero/comm/__init__.py).
_collectives: dict[str, Callable] = {}


def use_collectives(*, all_reduce: Callable, bookkeeping_device: Callable) -> None:
    """``all_reduce(tensor, op=..., what=...)``: a bounded all-reduce; ``bookkeeping_device(group)``: where it runs."""
    _collectives.update(all_reduce=all_reduce, bookkeeping_device=bookkeeping_device)


def _straggler_analysis(records: dict[str, dict[int, list]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Every latency's minimum over the ranks, in one all-reduce of all of them (same order on every rank), bounded
    like every hf_zero collective."""
    all_reduce, bookkeeping_device = _collectives["all_reduce"], _collectives["bookkeeping_device"]
    rows = [(name, size, row) for name, by_size in records.items() for size, row in sorted(by_size.items())]
    flat = [lat for _, _, row in rows for lat in row[1]]
    mins = list(flat)
    if _world_size(None) > 1:
        device = bookkeeping_device(None)
        counts = torch.tensor([len(flat), -len(flat)], dtype=torch.int64, device=device)
        with logger.quiet():
            all_reduce(counts, op=dist.ReduceOp.MAX, what="the comms logger's straggler analysis (op counts)")
        if counts[0].item() != -counts[1].item():
            raise RuntimeError(f"comms logger: rank {_rank()} recorded {len(flat)} collectives, another rank a "
                               f"different number; log_summary(show_straggler=True) needs every rank to have "
                               f"profiled the same collectives (same prof_all / prof_ops, reset_log on all ranks)")
        lats = torch.tensor(flat, dtype=torch.float64, device=device)
        with logger.quiet():
            all_reduce(lats, op=dist.ReduceOp.MIN, what="the comms logger's straggler analysis (latencies)")
        mins = lats.tolist()
    out: dict[str, dict[int, dict[str, Any]]] = {}
    at = 0
    for name, size, row in rows:
        own, fastest = row[1], mins[at:at + row[0]]
        at += row[0]
        waits = [a - b for a, b in zip(own, fastest)]
        out.setdefault(name, {})[size] = {
            "count": row[0], "total_comm_lat_ms": sum(fastest), "total_straggler_ms": sum(waits),
            "avg_comm_lat_ms": trimmed_mean(fastest), "avg_straggler_ms": trimmed_mean(waits),
            "msg_size_bytes": size, "msg_size_str": convert_size(size)}
    return out


logger = CommsLogger()  # the process's one logger: deepspeed.comm's and hf_zero's collectives record into it


def configure(*, enabled: bool | None = None, verbose: bool | None = None, prof_all: bool | None = None,
              prof_ops: Iterable[str] | None = None, debug: bool | None = None) -> None:
    """Change the switches of :data:`logger` that are not None."""
    logger.set(enabled=enabled, verbose=verbose, prof_all=prof_all, prof_ops=prof_ops, debug=debug)


def configure_from(section) -> None:
    """Apply a ``comms_logger`` section (anything with ``enabled``, ``verbose``, ``prof_all``, ``prof_ops``,
    ``debug``) when it is enabled. A disabled section changes nothing, so a logger switched on by
    ``deepspeed.comm.configure(enabled=True)`` stays on (DeepSpeed's engine likewise configures only from a
    ``comms_logger`` section it finds)."""
    if section.enabled:
        configure(enabled=True, verbose=section.verbose, prof_all=section.prof_all, prof_ops=section.prof_ops,
                  debug=section.debug)


def _payload_nbytes(payload) -> tuple[int, Any]:
    """The bytes of a tensor or a list of tensors (P2P ops: their ``.tensor``), and the device of the first."""
    if payload is None:
        return 0, None
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size(), payload.device
    tensors = [getattr(t, "tensor", t) for t in payload]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors), (tensors[0].device if tensors else None)


def timed_op(payload: str | None = None) -> Callable:
    """Decorate a DeepSpeed-signature collective (trailing ``prof``, ``log_name`` arguments, optional ``group`` and
    ``async_op``) so that the logger records it; ``payload`` names the argument whose tensor(s) this rank sends
    (None: no tensor, a message of 0 bytes). Off, the call costs one bool check."""
    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        default_name = signature.parameters["log_name"].default if "log_name" in signature.parameters else fn.__name__

        @functools.wraps(fn)
        def logged(*args, **kwargs):
            if not logger.enabled:
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments: Mapping[str, Any] = bound.arguments
            msg_nbytes, device = _payload_nbytes(arguments.get(payload) if payload else None)
            timing = logger.timing(fn.__name__, arguments.get("log_name", default_name), msg_nbytes,
                                   arguments.get("group"), device, prof=arguments.get("prof", False))
            if timing is None:
                return fn(*args, **kwargs)
            timing.start()
            result = fn(*args, **kwargs)
            if result is not None and hasattr(result, "wait") and (arguments.get("async_op") or fn.__name__ in
                                                                   ("isend", "irecv")):
                return TimedWork(result, timing)
            timing.stop()
            return result

        return logged

    return decorate
