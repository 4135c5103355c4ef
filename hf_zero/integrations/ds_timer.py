"""``deepspeed.utils.timer``: the named wall-clock timers (Megatron's) and the samples-per-second meter that
DeepSpeed-era training scripts drive by hand, with DeepSpeed's method names and units.

- :class:`SynchronizedWallClockTimer`: ``timers("fwd").start()`` / ``.stop()`` / ``.elapsed(reset=True)``
  (milliseconds summed over the start/stop intervals since the last reset) / ``.reset()`` / ``.mean()``;
  ``timers.log(names, normalizer=...)`` prints ``time (ms) | fwd: 12.34 | ...`` on rank 0.
- :class:`ThroughputTimer` (hf_zero/profiling/throughput_timer.py, also ``engine.tput_timer``): ``start()``/
  ``stop(global_step=True)`` around each micro step; ``avg_samples_per_sec()`` over the steps after warm-up.

Intervals are host wall-clock time after synchronising the device (CUDA work is asynchronous; DeepSpeed records
CUDA events instead -- the same intervals, measured at the host).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from hf_zero.comm.accelerator import get_accelerator
from hf_zero.integrations.ds_utils import print_dist
from hf_zero.profiling.throughput_timer import ThroughputTimer

__all__ = ["SynchronizedWallClockTimer", "NoopTimer", "ThroughputTimer", "trim_mean"]


def trim_mean(data: Iterable[float], trim_percent: float) -> float:
    """Mean of ``data`` without its ``trim_percent`` smallest and largest values (0 for no data)."""
    assert 0.0 <= trim_percent <= 1.0
    data = sorted(data)
    if not data:
        return 0
    k = int(round(len(data) * trim_percent))
    kept = data[k:len(data) - k]
    return sum(kept) / len(kept)


class SynchronizedWallClockTimer:
    """A group of named timers; ``timers(name)`` creates one on first use."""

    class Timer:
        def __init__(self, name: str):
            self.name_ = name
            self.started_ = False
            self.start_time = 0.0
            self.intervals_s: list[float] = []  # one per start/stop since the last reset
            self.elapsed_records: list[float] | None = None  # milliseconds, filled by elapsed()/mean()

        def start(self) -> None:
            assert not self.started_, f"{self.name_} timer has already been started"
            get_accelerator().synchronize()
            self.start_time = time.time()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            """End the current interval (``reset``/``record`` are accepted and unused, as in DeepSpeed)."""
            assert self.started_, "timer is not started"
            get_accelerator().synchronize()
            self.intervals_s.append(time.time() - self.start_time)
            self.started_ = False

        def reset(self) -> None:
            self.started_ = False
            self.elapsed_records = None
            self.intervals_s.clear()

        def _elapsed_ms(self) -> float:
            self.elapsed_records = [s * 1000.0 for s in self.intervals_s]
            return sum(self.elapsed_records)

        def elapsed(self, reset: bool = True) -> float:
            """Milliseconds over every interval since the last reset; a running timer counts up to now and keeps
            running."""
            running = self.started_
            if running:
                self.stop()
            elapsed_ms = self._elapsed_ms()
            if reset:
                self.reset()
            if running:
                self.start()
            return elapsed_ms

        def mean(self) -> float:
            """Trimmed (10%) mean interval, in milliseconds."""
            self.elapsed(reset=False)
            return trim_mean(self.elapsed_records, 0.1)

    def __init__(self):
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def __call__(self, name: str) -> "SynchronizedWallClockTimer.Timer":
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    def get_timers(self) -> dict[str, "SynchronizedWallClockTimer.Timer"]:
        return self.timers

    @staticmethod
    def memory_usage() -> str:
        acc, gb = get_accelerator(), 1024**3
        return (f" | mem_allocated: {acc.memory_allocated() / gb:.4f} GB | max_mem_allocated: "
                f"{acc.max_memory_allocated() / gb:.4f} GB | cache_allocated: {acc.memory_reserved() / gb:.4f} GB"
                f" | max_cache_allocated: {acc.max_memory_reserved() / gb:.4f} GB")

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: Iterable[int] | None = None) -> None:
        """Print ``time (ms) | name: elapsed/normalizer | ...`` for the named timers that exist, on ``ranks``
        (default rank 0)."""
        assert normalizer > 0.0
        text = "time (ms)"
        for name in names:
            if name in self.timers:
                text += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        print_dist(text, ranks=ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """name -> trimmed mean interval * 1000 / normalizer, DeepSpeed's scaling (its ``mean()`` is already in ms,
        so these numbers are microseconds when ``normalizer`` is 1)."""
        assert normalizer > 0.0
        return {name: self.timers[name].mean() * 1000.0 / normalizer for name in names if name in self.timers}


class NoopTimer:
    """The timer group DeepSpeed hands out when timing is off: every call does nothing, every reading is 0."""

    class Timer:
        def start(self) -> None: ...

        def reset(self) -> None: ...

        def stop(self, **kwargs) -> None: ...

        def elapsed(self, **kwargs) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self):
        self.timer = self.Timer()

    def __call__(self, name: str) -> "NoopTimer.Timer":
        return self.timer

    def get_timers(self) -> dict:
        return {}

    def log(self, names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None) -> None: ...

    def get_mean(self, names, normalizer=1.0, reset=True) -> None: ...
