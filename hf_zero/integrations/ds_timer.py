"""``deepspeed.utils.timer``: the named wall-clock timers (Megatron's) and the samples-per-second meter that
DeepSpeed-era training scripts drive by hand, with DeepSpeed's method names and units.

- :class:`SynchronizedWallClockTimer`: ``timers("fwd").start()`` / ``.stop()`` / ``.elapsed(reset=True)``
  (milliseconds summed over the start/stop intervals since the last reset) / ``.reset()`` / ``.mean()``;
  ``timers.log(names, normalizer=...)`` prints ``time (ms) | fwd: 12.34 | ...`` on rank 0.
- :class:`ThroughputTimer`: ``start()``/``stop(global_step=True)`` around each micro step; steps before
  ``start_step`` are warm-up and not timed; ``avg_samples_per_sec()`` = batch size / mean seconds per timed step.

Intervals are host wall-clock time after synchronising the device (CUDA work is asynchronous; DeepSpeed records
CUDA events instead -- the same intervals, measured at the host).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from types import SimpleNamespace

from hf_zero.comm.accelerator import get_accelerator
from hf_zero.integrations.compat import logger
from hf_zero.integrations.ds_utils import print_dist

__all__ = ["SynchronizedWallClockTimer", "NoopTimer", "ThroughputTimer", "trim_mean"]

_TIME_EPSILON = 1e-6


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


class ThroughputTimer:
    """Samples per second over the timed steps. ``config`` has ``enabled`` and ``synchronized`` (DeepSpeed's
    ``timers.throughput`` section); None means both true."""

    def __init__(self, config, batch_size: int | None, start_step: int = 2, steps_per_output: int | None = None,
                 monitor_memory: bool = False, logging_fn=None):
        self.config = SimpleNamespace(enabled=True, synchronized=True) if config is None else config
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # seconds over the timed steps
        self.step_elapsed_time = 0.0  # seconds in the current global step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logger.info if logging_fn is None else logging_fn
        self.initialized = False

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.config.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:  # past warm-up: this step is timed
            if self.config.synchronized:
                get_accelerator().synchronize()
            self.start_time = time.time()

    def _is_report_boundary(self) -> bool:
        return self.steps_per_output is not None and self.global_step_count % self.steps_per_output == 0

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        if self.config.synchronized:
            get_accelerator().synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        if report_speed and self._is_report_boundary():
            acc = get_accelerator()
            self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                         f"global_step={self.global_step_count}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                         f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + _TIME_EPSILON)}, "
                         f"MemAllocated={round(acc.memory_allocated() / 1024**3, 2)}GB, "
                         f"MaxMemAllocated={round(acc.max_memory_allocated() / 1024**3, 2)}GB")
            if self.monitor_memory:
                import psutil

                self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                             f"global_step={self.global_step_count}, vm %: {psutil.virtual_memory().percent}, "
                             f"swap %: {psutil.swap_memory().percent}")
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """``batch_size`` / mean seconds of the global steps timed so far (those after ``start_step``); ``-inf``
        before any is timed."""
        timed_steps = self.global_step_count - self.start_step
        if self.global_step_count > 0 and timed_steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")
