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

    def _watch(self, done: threading.Event) -> None:
        while not done.wait(self.poll_s):
            message = self._peer_failure()
            if message is not None:
                self.failed = message
                self._abort()  # unblocks this rank's pending receives and collectives
                return

    @contextlib.contextmanager
    def step(self, what: str):
        if self.failed is not None:
            raise PipelineStageFailure(f"the pipeline is broken since an earlier failure: {self.failed}")
        done = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(done,), daemon=True, name="hf_zero-pipe-watch")
        watcher.start()
        try:
            yield
        except BaseException as exc:
            done.set()
            watcher.join()
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
            done.set()
        watcher.join()
        if self.failed is not None:
            raise PipelineStageFailure(f"{self.describe} (global rank {self.rank}) stopped because {self.failed}")
