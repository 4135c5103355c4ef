"""Per-phase wall-clock timers for ``wall_clock_breakdown`` (forward, backward, reduce, step, gather)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

__all__ = ["PhaseTimers", "NO_TIMERS"]


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
