"""The recorded gather order, and what it says about the future: what to prefetch, what to keep.

The first iteration of each kind (grad enabled / disabled) is *recorded*: the sequence of module uses
(forward and backward gather requests, by group id). Later iterations walk that trace. At each request the walker
advances to the matching entry -- skipping ahead if the model took a shortcut, never re-recording -- and answers:

- :meth:`GatherTrace.upcoming`: the next groups, up to ``prefetch_numel`` elements, to gather ahead;
- :meth:`GatherTrace.reused_within`: whether a group comes back within ``max_reuse_distance`` elements (then
  its parameters stay gathered instead of being freed and gathered again).

Every rank walks the same trace with the same requests, so the prefetch collectives they issue agree.

A request that is not ahead in the trace (the model took another path than the recorded one) is a *miss*: the
walker keeps its position and ``on_miss(gid)`` is called -- with ``zero_optimization.log_trace_cache_warnings``
the runtime logs it, once per iteration, naming the module (DeepSpeed logs the invalidation of its trace cache).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["GatherTrace"]


class GatherTrace:
    def __init__(self, group_numel: dict[int, int], on_miss: Callable[[int], None] | None = None) -> None:
        self._group_numel = group_numel  # group id -> elements it gathers
        self._on_miss = on_miss
        self._traces: dict[bool, list[int]] = {}
        self._mode: bool | None = None
        self._recording: list[int] | None = None
        self._pos = 0

    @property
    def recording(self) -> bool:
        return self._recording is not None

    @property
    def recorded(self) -> bool:
        """Whether an iteration's order has been recorded (and not forgotten since)."""
        return bool(self._traces)

    def begin_iteration(self, mode: bool) -> None:
        self.end_iteration()
        self._mode = mode
        self._pos = 0
        if mode not in self._traces:
            self._recording = []

    def end_iteration(self) -> None:
        if self._recording is not None and self._mode is not None:
            self._traces[self._mode] = self._recording
        self._recording = None
        self._mode = None

    def forget(self) -> None:
        """Drop recorded traces (the module structure changed); the next iteration records again."""
        self._traces.clear()
        self._recording = None
        self._mode = None

    def request(self, gid: int) -> None:
        """A module asks for its group ``gid``."""
        if self._recording is not None:
            self._recording.append(gid)
            return
        trace = self._traces.get(self._mode) if self._mode is not None else None
        if not trace:
            return
        try:
            self._pos = trace.index(gid, self._pos) + 1
        except ValueError:  # not ahead in the trace: leave the position, the next request may resynchronize
            if self._on_miss is not None:
                self._on_miss(gid)

    def _ahead(self):
        if self._recording is not None or self._mode is None:
            return []
        trace = self._traces.get(self._mode, [])
        return trace[self._pos:]

    def upcoming(self, budget_numel: int, *, min_groups: int = 0) -> list[int]:
        """Group ids coming next, while their total elements stay within ``budget_numel`` (the first
        ``min_groups`` of them whatever their size)."""
        out, total = [], 0
        for gid in self._ahead():
            n = self._group_numel[gid]
            if total + n > budget_numel and len(out) >= min_groups:
                break
            out.append(gid)
            total += n
        return out

    def reused_within(self, gids: set[int], distance_numel: int) -> bool:
        """Does any group in ``gids`` come back before ``distance_numel`` elements of other gathers pass?"""
        if distance_numel <= 0:
            return False
        total = 0
        for gid in self._ahead():
            if gid in gids:
                return True
            total += self._group_numel[gid]
            if total > distance_numel:
                return False
        return False
