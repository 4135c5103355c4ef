"""Run a function on N CPU processes with gloo, the way the tests of every distributed feature do.

    results = run_distributed(fn, world_size=2, args=(...,))   # fn(*args) on ranks 0 and 1

Each rank is a fresh process with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set, the
caller's environment and working directory, one torch thread (2-core machines run 4 ranks), and a gloo process group
already initialized unless ``init_process_group=False`` (for testing code that initializes it itself). A failure on
any rank is reported with that rank's traceback; a rank that does not finish within ``timeout_s`` fails the call
instead of hanging CI.

Start-up cost: a spawned rank imports torch (and, for model tests, transformers' modeling code) from scratch, about
5 CPU-seconds each -- most of a small test's time on 2 cores (4 ranks of a tiny-Llama test: ~100 s spawned, 3-6 s
forked, at load 15). So by default (``fork_server=True``) the ranks start from a fork server: one process per pytest
session imports :data:`FORK_SERVER_PRELOAD` once, and every rank is forked from it with those modules loaded. A
forked rank holds nothing of the caller's state (no CUDA, no process group, no patched module). It does get the
caller's current environment and working directory; what is fixed when the server starts is only what those modules
read from the environment at import, and what the C library reads at process start (glibc's ``MALLOC_*``): a test
that sets such a variable passes ``fork_server=False`` to spawn fresh interpreters.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import time
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

from hf_zero.comm.process_group import free_port

__all__ = ["run_distributed", "DistributedFailure", "free_port"]


class DistributedFailure(AssertionError):
    """One or more ranks raised, or did not finish in time. ``per_rank`` maps rank -> traceback text."""

    def __init__(self, message: str, per_rank: dict[int, str]):
        self.per_rank = per_rank
        super().__init__(message)


def _worker(fn: Callable, args: Sequence[Any], kwargs: dict, rank: int, world_size: int, port: int,
            init: bool, env: dict[str, str], results: Any, base: tuple[dict[str, str], str] | None = None) -> None:
    if base is not None:  # forked from the fork server: take the caller's environment and directory, not its own
        os.environ.clear()
        os.environ.update(base[0])
        os.chdir(base[1])
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(*args, **kwargs)
        # plain pickle copies tensors by value; the queue's own reducer would pass shared-memory handles that die
        # with this process
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including AssertionError and SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (), kwargs: dict | None = None, *,
                    timeout_s: float = 180.0, init_process_group: bool = True,
                    env: dict[str, str] | None = None, fork_server: bool = True) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes; return each rank's return value, rank-ordered.

    ``fn`` and its arguments must be picklable (a module-level function). Raises :class:`DistributedFailure`
    naming every rank that raised (with its traceback) or that was still running after ``timeout_s``.

    ``fork_server``: fork the ranks from a server that has imported torch and transformers (the default), or spawn
    them as new interpreters (``False``; module docstring says when).
    """
    if fork_server:
        ctx, base = _forkserver(), (dict(os.environ), os.getcwd())
    else:
        ctx, base = mp.get_context("spawn"), None
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, tuple(args), dict(kwargs or {}), rank, world_size, port, init_process_group,
                               dict(env or {}), results, base))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    outcome: dict[int, tuple[bool, Any]] = {}
    while len(outcome) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
            outcome[rank] = (ok, value)
        except queue_mod.Empty:
            # A rank that died without reporting (segfault, os._exit) will never report: stop waiting for it.
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcome]
            if dead:
                time.sleep(0.5)  # its message may still be in flight
                while True:
                    try:
                        rank, ok, value = results.get_nowait()
                        outcome[rank] = (ok, value)
                    except queue_mod.Empty:
                        break
                for r in dead:
                    if r not in outcome:
                        outcome[r] = (False, f"rank {r} exited with code {procs[r].exitcode} without reporting")
    for rank, p in enumerate(procs):
        if rank in outcome:  # reported: let it tear its process group down; a rank that never reported is killed
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    failures = {r: v for r, (ok, v) in outcome.items() if not ok}
    missing = [r for r in range(world_size) if r not in outcome]
    for r in missing:
        failures[r] = f"rank {r} did not finish within {timeout_s:.0f}s (hang?)"
    if failures:
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise DistributedFailure(f"{len(failures)} of {world_size} ranks failed (ranks {sorted(failures)}):\n{body}",
                                 failures)
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


# What the fork server imports once (a module missing here is skipped by the server, then imported by the ranks
# that need it). hf_zero is not among them: it is cheap to import, and some of its modules read the environment a
# test sets.
FORK_SERVER_PRELOAD = ("torch", "torch.distributed.tensor", "transformers", "transformers.models.llama.modeling_llama",
                       "transformers.models.gpt2.modeling_gpt2", "peft")


def _forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORK_SERVER_PRELOAD))  # read when the server starts (first use)
    return ctx
