"""DeepSpeed's samples-per-second meter (``ThroughputTimer``): what ``engine.tput_timer`` is, and what
``deepspeed.utils.timer.ThroughputTimer`` gives scripts that drive one by hand.

``start()`` before a micro-step's forward, ``stop(global_step=...)`` after its step: the intervals of the global steps
after ``start_step`` (warm-up) are summed; ``avg_samples_per_sec()`` is the batch size over their mean. Every
``steps_per_output`` global steps ``stop(report_speed=True)`` logs DeepSpeed's line (``RunningAvgSamplesPerSec=...``).
``update_epoch_count()`` is what DeepSpeed-Chat's scripts call after each epoch. Intervals are host wall-clock time
after synchronising the device when ``synchronized`` (DeepSpeed's default; CUDA work is asynchronous).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from hf_zero.comm.accelerator import get_accelerator

__all__ = ["ThroughputTimer"]

logger = logging.getLogger("hf_zero")
_TIME_EPSILON = 1e-6  # keeps a report's division finite for a step that took no measurable time


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
