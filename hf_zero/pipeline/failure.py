"""Fail fast: a pipeline stage that fails ends every other stage with an error naming it, in bounded time.

Without this, the other stages wait in a receive for an activation or gradient that never comes. The pipeline uses
the fault channel every hf_zero collective uses (comm/faults.py), on the default group -- one place where a job's
first fault is published, one monitor thread per group, one diagnosis of dead and stopped ranks:

- a stage whose step raises publishes "which stage, which rank, what" as the job's fault and aborts its pipeline
  groups; an error that is itself a failed collective (a peer died, a receive timed out) is diagnosed first, so
  the fault names the dead or stopped rank rather than the broken connection;
- every other rank's channel monitor reads the fault within its period; a rank inside a step is interrupted -- its
  pipeline groups aborted, which ends its pending receives where the backend supports it -- and its step raises
  :class:`PipelineStageFailure` quoting the published fault; a rank still blocked ``grace`` seconds later ends
  there, printing it (faults.FaultChannel.watch), as a rank blocked in any hf_zero collective does;
- a stage that stops answering (stopped, hung) inside a receive hf_zero cannot wrap (torch.distributed.pipelining
  issues it) is noticed the same way: its heartbeat is older than ``comms_timeout_s``; the pipeline's groups also
  get ``comms_timeout_s`` as their own timeout where the backend honours it.

Ranks that failed exit non-zero when Python exits, as for any fault.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from hf_zero.comm import faults

__all__ = ["StageFailureGuard", "PipelineStageFailure"]


class PipelineStageFailure(RuntimeError):
    """Raised on every rank of a pipeline when one of its stages failed during a step."""


class StageFailureGuard:
    def __init__(self, grid, *, describe: str, poll_s: float | None = None):
        # poll_s: accepted for callers of the old watcher; the channel's monitor period applies
        self.grid = grid
        self.describe = describe
        self.rank = dist.get_rank()
        self.failed: str | None = None
        self._channel = faults.channel_for(None)  # None in a world of one: nothing to tell anyone
        for group in self._groups():
            faults.bound_group(group)

    def _groups(self) -> set:
        return {g for g in (self.grid.get_pipe_parallel_group(), self.grid.get_data_parallel_group(),
                            self.grid.get_model_parallel_group(), self.grid.get_slice_parallel_group())
                if g is not None}

    def _abort(self) -> None:
        for group in self._groups():
            with contextlib.suppress(Exception):
                group.abort()

    def _interrupt(self, message: str) -> None:
        """The channel's monitor thread: a peer published a fault while this rank runs a step."""
        self.failed = message
        self._abort()  # unblocks this rank's pending receives and collectives

    def _peer_fault(self) -> str | None:
        if self._channel is None:
            return None
        first = self._channel.published()
        if first is None or first.startswith(f"rank {self.rank}:"):
            return None
        return first

    @contextlib.contextmanager
    def step(self, what: str):
        if self.failed is not None:
            raise PipelineStageFailure(f"the pipeline is broken since an earlier failure: {self.failed}")
        ch = self._channel
        try:
            with ch.watch(what, self._interrupt) if ch is not None else contextlib.nullcontext():
                yield
        except BaseException as exc:
            if self.failed is None:
                with contextlib.suppress(Exception):
                    self.failed = self._peer_fault()
            if self.failed is not None:  # a peer failed first; this rank's error is the consequence
                if ch is not None:  # this rank ends with the job (exit status 1), as any rank a fault reaches
                    ch.fail(faults.PeerFailure(f"hf_zero: rank {self.rank} stops because {self.failed}"))
                raise PipelineStageFailure(f"{self.describe} (global rank {self.rank}) stopped because "
                                           f"{self.failed}") from exc
            if ch is not None and faults.is_comm_error(exc):
                # a receive or collective failed under this stage: say which rank died or stopped, not "connection
                # closed" -- the diagnosis every hf_zero collective gets
                diagnosis = ch.diagnose(what, faults.timeout_s(), exc)
                message = f"{self.describe} (global rank {self.rank}) stopped in {what}: {diagnosis}"
            else:
                root = exc
                while root.__cause__ is not None:  # torch wraps a stage's error ("failed to run forward")
                    root = root.__cause__
                message = (f"{self.describe} (global rank {self.rank}) failed in {what}: "
                           f"{type(root).__name__}: {str(root).strip()}")
            if ch is not None:
                ch.fail(PipelineStageFailure(message))  # published before the abort below breaks the peers' waits
            self.failed = message
            self._abort()
            raise PipelineStageFailure(message) from exc
        if self.failed is not None:
            raise PipelineStageFailure(f"{self.describe} (global rank {self.rank}) stopped because {self.failed}")
