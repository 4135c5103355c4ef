"""Fail fast: a pipeline stage that raises ends every other stage with an error naming it, in bounded time.

Without this, the other stages wait in a receive for an activation or gradient that never comes, until the
process-group timeout (30 minutes by default). While a step runs, each rank's guard watches one key in the
rendezvous store: a failing rank writes "which stage, which rank, what" there, and aborts its pipeline group; every
other rank's watcher sees the key within ``poll_s``, aborts its own communicators, and the step on that rank raises
:class:`PipelineStageFailure` quoting the failing rank's message.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch.distributed as dist

__all__ = ["StageFailureGuard", "PipelineStageFailure"]

_KEY = "hf_zero/pipeline_failure"


class PipelineStageFailure(RuntimeError):
    """Raised on every rank of a pipeline when one of its stages failed during a step."""


class StageFailureGuard:
    def __init__(self, grid, *, describe: str, poll_s: float = 0.2):
        self.grid = grid
        self.describe = describe
        self.poll_s = poll_s
        self.rank = dist.get_rank()
        self._store = dist.distributed_c10d._get_default_store()
        self.failed: str | None = None
        self._active = threading.Event()  # set while a step runs: the watcher polls only then
        self._watcher: threading.Thread | None = None

    def _peer_failure(self) -> str | None:
        if self._store.check([_KEY]):
            return self._store.get(_KEY).decode()
        return None

    def _abort(self) -> None:
        for group in {self.grid.get_pipe_parallel_group(), self.grid.get_data_parallel_group(),
                      self.grid.get_model_parallel_group(), self.grid.get_slice_parallel_group()}:
            if group is not None:
                with contextlib.suppress(Exception):
                    group.abort()

    def _watch(self) -> None:
        while True:
            self._active.wait()
            time.sleep(self.poll_s)
            if not self._active.is_set():
                continue
            message = self._peer_failure()
            if message is not None:
                self.failed = message
                self._abort()  # unblocks this rank's pending receives and collectives
                return

    @contextlib.contextmanager
    def step(self, what: str):
        if self.failed is not None:
            raise PipelineStageFailure(f"the pipeline is broken since an earlier failure: {self.failed}")
        if self._watcher is None:
            # one watcher for the guard's life, idle between steps: starting and joining a thread per step cost
            # ~2 ms on the step's critical path on a loaded machine
            self._watcher = threading.Thread(target=self._watch, daemon=True, name="hf_zero-pipe-watch")
            self._watcher.start()
        self._active.set()
        try:
            yield
        except BaseException as exc:
            self._active.clear()
            if self.failed is None:
                with contextlib.suppress(Exception):
                    self.failed = self._peer_failure()
            if self.failed is not None:  # a peer failed first; this rank's error is the consequence
                raise PipelineStageFailure(f"{self.describe} (global rank {self.rank}) stopped because "
                                           f"{self.failed}") from exc
            root = exc
            while root.__cause__ is not None:  # torch wraps a stage's error ("failed to run forward"): name the cause
                root = root.__cause__
            message = (f"{self.describe} (global rank {self.rank}) failed in {what}: "
                       f"{type(root).__name__}: {str(root).strip()}")
            with contextlib.suppress(Exception):
                self._store.set(_KEY, message)
            self.failed = message
            self._abort()
            raise PipelineStageFailure(message) from exc
        finally:
            self._active.clear()
        if self.failed is not None:
            raise PipelineStageFailure(f"{self.describe} (global rank {self.rank}) stopped because {self.failed}")
