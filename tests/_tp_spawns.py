"""One process group per world size for all the tensor-parallel tests (``test_tp_*.py``).

Starting ranks and a gloo group is most of what a small distributed test costs on 2 cores, so the TP tests do not
spawn per test: each test module registers its cases at import (pytest imports every module before the first test
runs), and the first test that asks for a world size runs every case registered for it in one
:func:`~hf_zero.testing.run_distributed` call, forked from a server that has already imported torch and
transformers. Tests then assert on the cached results::

    register(2, "parity", _tp_worker, ("llama", "gpt2"))   # at module level
    per_rank = case(2, "parity")                            # in the test: [rank 0's value, rank 1's value]

A case that raises on some rank fails only the tests that read it, with that rank's traceback; the other cases'
results stand. If a world's run dies or hangs, every test of that world fails with the error and the case each
rank was in. ``after=(2,)``: the case reads what a world-2 case wrote (the checkpoint written at TP 2 and
reloaded at TP 1 and 4), so that world runs first.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from hf_zero.testing import DistributedFailure, run_distributed

TIMEOUT_S = {1: 300, 2: 420, 4: 600, 8: 600}

# stands for a directory the cases of every world share (checkpoints) in a case's arguments; made when the first
# group runs and removed when pytest exits (not at import: the ranks import the test modules too)
SHARED_DIR = "<tp tests shared dir>"


@functools.cache
def _shared_dir() -> str:
    path = tempfile.mkdtemp(prefix="hf_zero_tp_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@dataclass
class _World:
    cases: dict[str, tuple[Callable, tuple]] = field(default_factory=dict)
    after: set[int] = field(default_factory=set)
    results: list[dict] | None = None
    error: BaseException | None = None


_WORLDS: dict[int, _World] = {}


def register(world_size: int, name: str, fn: Callable, args: tuple = (), *, after: tuple[int, ...] = ()) -> None:
    """Run ``fn(*args)`` on every rank of the shared ``world_size`` group (``fn``: module level, picklable)."""
    world = _WORLDS.setdefault(world_size, _World())
    if world.results is not None or world.error is not None:
        raise RuntimeError(f"case {name!r} registered after the world-{world_size} group ran")
    world.cases[name] = (fn, tuple(args))
    world.after.update(after)


def case(world_size: int, name: str) -> list[Any]:
    """Every rank's return value of case ``name``; raises naming the case and rank if it failed anywhere."""
    per_rank = _run(world_size)
    failed = {r: out[name][1] for r, out in enumerate(per_rank) if not out[name][0]}
    if failed:
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        raise AssertionError(f"case {name!r} (world {world_size}) failed on ranks {sorted(failed)}:\n{body}")
    return [out[name][1] for out in per_rank]


def _run(world_size: int) -> list[dict]:
    world = _WORLDS[world_size]
    if world.results is None and world.error is None:
        for first in sorted(world.after):
            _run(first)
        progress = os.path.join(_shared_dir(), f"progress-{world_size}")
        os.makedirs(progress, exist_ok=True)
        cases = {name: (fn, tuple(_shared_dir() if a == SHARED_DIR else a for a in args))
                 for name, (fn, args) in world.cases.items()}
        try:
            world.results = run_distributed(_run_cases, world_size, args=(cases, progress),
                                            timeout_s=TIMEOUT_S.get(world_size, 600), fork_server=True)
        except DistributedFailure as exc:
            world.error = exc
            where = {f: open(os.path.join(progress, f)).read() for f in sorted(os.listdir(progress))}
            exc.args = (f"{exc.args[0]}\ncase each rank was in: {where}",)
    if world.error is not None:
        raise world.error
    return world.results


def _run_cases(cases: dict[str, tuple[Callable, tuple]], progress: str) -> dict[str, tuple[bool, Any]]:
    import torch.distributed as dist

    out = {}
    for name, (fn, args) in cases.items():
        with open(os.path.join(progress, f"rank{dist.get_rank()}"), "w") as f:
            f.write(name)
        try:
            out[name] = (True, fn(*args))
        except Exception:
            out[name] = (False, traceback.format_exc())
    return out
