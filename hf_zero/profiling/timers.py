"""Per-phase wall-clock timers for ``wall_clock_breakdown`` (forward, backward, reduce, step, gather).

:class:`PhaseTimers` are what the engine hands its components; the engine resets them at every step when
``wall_clock_breakdown`` logs them. :class:`TotalingTimers` behave the same towards the engine (``reset()`` still
returns and clears the current window) but also add every window to a total that :meth:`TotalingTimers.totals`
reports: the HF callback's time shares come from there.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

__all__ = ["PhaseTimers", "NO_TIMERS", "TotalingTimers"]


class PhaseTimers:
    """Accumulates seconds per phase between two ``reset()`` calls. Disabled timers cost one branch."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        if self.enabled:
            self.seconds[name] += seconds

    def summary(self) -> str:
        return " | ".join(f"{name}: {1000 * s:.1f} ms" for name, s in self.seconds.items())

    def reset(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


# What components (gradient reducers, gatherers, offload) time with until an engine hands them its own timers.
NO_TIMERS = PhaseTimers(enabled=False)


class TotalingTimers(PhaseTimers):
    def __init__(self):
        super().__init__(enabled=True)
        self._closed: dict[str, float] = {}

    @classmethod
    def replacing(cls, timers: PhaseTimers) -> "TotalingTimers":
        """Always-on timers that continue ``timers``' current window."""
        new = cls()
        new.seconds.update(timers.seconds)
        return new

    def reset(self) -> dict[str, float]:
        window = super().reset()
        for name, seconds in window.items():
            self._closed[name] = self._closed.get(name, 0.0) + seconds
        return window

    def totals(self) -> dict[str, float]:
        out = dict(self._closed)
        for name, seconds in self.seconds.items():
            out[name] = out.get(name, 0.0) + seconds
        return out
