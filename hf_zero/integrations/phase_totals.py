"""Phase timers that keep running totals, for the HF callback's time shares.

The engine's :class:`~hf_zero.runtime.timers.PhaseTimers` are reset at every step when ``wall_clock_breakdown`` logs
them; :class:`TotalingTimers` behaves the same towards the engine (``reset()`` still returns and clears the
current window) but also adds every window to a total that :meth:`totals` reports.
"""

from __future__ import annotations

from hf_zero.runtime.timers import PhaseTimers

__all__ = ["TotalingTimers"]


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
