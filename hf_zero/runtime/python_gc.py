"""``disable_python_gc`` (DeepSpeed 0.19): Python's automatic cyclic garbage collector off while engines live.

A cyclic collection walks every tracked object; in a training loop that holds millions of them (autograd graphs,
module trees, the data pipeline) it can pause a step for tens of milliseconds at an arbitrary point, and on many
ranks the slowest rank's pause is everyone's. With the key set, the first engine collects once and turns automatic
collection off; the script collects where it is harmless (``engine.collect_python_gc()``, e.g. between steps);
when the last such engine is destroyed, automatic collection comes back if it was on before.

The state is the process's (``gc`` is process-wide), so the engines share one count. A forked child (a data-loader
worker) starts with the count at zero and collection as it was before the first engine turned it off.
"""

from __future__ import annotations

import gc
import logging
import os
import threading

__all__ = ["PythonGC", "python_gc"]

logger = logging.getLogger("hf_zero")


class PythonGC:
    """The process's one switch; :meth:`hold` returns a token that :meth:`release` gives back (once)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False
        self._epoch = 0  # a token from before a fork is not the child's to release
        if hasattr(os, "register_at_fork"):
            # the lock is looked up at each fork: a child replaces its copy (held across the fork) with a new one
            os.register_at_fork(before=lambda: self._lock.acquire(), after_in_parent=lambda: self._lock.release(),
                                after_in_child=self._reset_in_child)

    def _reset_in_child(self) -> None:
        if self._holders and self._was_enabled:
            gc.enable()
        self._holders, self._was_enabled = 0, False
        self._epoch += 1
        self._lock = threading.Lock()

    @property
    def holders(self) -> int:
        return self._holders

    def hold(self) -> int:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                if self._was_enabled:
                    collected = gc.collect()
                    gc.disable()
                    logger.info("hf_zero: disable_python_gc: automatic Python cyclic GC off (collected %d objects "
                                "first); call engine.collect_python_gc() where a pause is harmless", collected)
            self._holders += 1
            return self._epoch

    def release(self, token: int) -> None:
        with self._lock:
            if token != self._epoch or self._holders == 0:
                return
            self._holders -= 1
            if self._holders == 0 and self._was_enabled:
                self._was_enabled = False
                gc.enable()
                logger.info("hf_zero: disable_python_gc: automatic Python cyclic GC back on")

    @staticmethod
    def collect() -> int:
        """One full collection now; automatic collection stays as it is. Returns what ``gc.collect()`` found."""
        return gc.collect()


python_gc = PythonGC()
