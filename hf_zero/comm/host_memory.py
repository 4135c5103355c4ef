"""This process's memory as the CPU accelerator reports it: resident set size (RSS), and its peak.

On a CPU-only machine every tensor lives in process memory, so "allocated" is the resident set, as DeepSpeed's
CPU accelerator answers it. The peak is the kernel's own high-water mark (``VmHWM`` in ``/proc/self/status``,
which sees spikes between two calls), reset through ``/proc/self/clear_refs`` (Linux >= 4.0). Where either is
unavailable, the peak is the largest RSS seen by these functions since the last reset.
"""

from __future__ import annotations

import os

import psutil

__all__ = ["rss_bytes", "peak_rss_bytes", "reset_peak_rss"]

_sampled_peak = 0


def rss_bytes() -> int:
    global _sampled_peak
    rss = psutil.Process().memory_info().rss
    _sampled_peak = max(_sampled_peak, rss)
    return rss


def _kernel_peak() -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    current = rss_bytes()
    kernel = _kernel_peak()
    return max(kernel, current) if kernel is not None else _sampled_peak


def reset_peak_rss() -> None:
    """Start a new peak at the current RSS."""
    global _sampled_peak
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (VmHWM) to the current one
    except OSError:
        pass
    _sampled_peak = 0
    rss_bytes()
