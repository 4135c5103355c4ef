"""Step -> value schedules for every method: when quantization starts, how bits and densities move over time.

Pure functions of the global step, so a resumed run computes exactly what the uninterrupted run had.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DensitySchedule", "BitSchedule"]


@dataclasses.dataclass(frozen=True)
class DensitySchedule:
    """Density (fraction kept) 1.0 before ``offset``; then the cubic ramp of Zhu & Gupta (2017)
    ``target + (1 - target) * (1 - t)^3`` with ``t = (step - offset) / (end - offset)``, updated every ``stride``
    steps, reaching ``target`` at ``end``. ``end == offset`` (the default) prunes in one shot at ``offset``."""

    target: float
    offset: int = 0
    end: int | None = None
    stride: int = 1

    def at(self, step: int) -> float:
        if step < self.offset:
            return 1.0
        end = self.offset if self.end is None else self.end
        if step >= end:
            return self.target
        step = self.offset + ((step - self.offset) // self.stride) * self.stride
        t = (step - self.offset) / (end - self.offset)
        return self.target + (1.0 - self.target) * (1.0 - t) ** 3


@dataclasses.dataclass(frozen=True)
class BitSchedule:
    """0 (off) before ``offset``; then ``start_bits``, one bit less every ``period`` steps, down to ``target_bits``."""

    start_bits: int
    target_bits: int
    offset: int = 0
    period: int = 0

    def at(self, step: int) -> int:
        if step < self.offset:
            return 0
        if self.period <= 0:
            return self.target_bits
        return max(self.target_bits, self.start_bits - (step - self.offset) // self.period)
