"""A cache of large blocks inside torch's CPU allocator (``csrc/alloc/host_cache.cpp``), for CPU training.

On a CPU run hf_zero fixes glibc's mmap threshold (``hf_zero.comm.host_memory.tune_host_malloc``) so that freed
tensors are handed back to the kernel instead of staying as holes in the heap. Every tensor of that size and more
is then a fresh mmap whose pages the kernel faults in and zeroes on first touch, and a training step allocates
the same sizes every iteration: ~100k page faults (400 MB) per ZeRO-3 step per rank on the 32M Llama. With the
cache, a freed block of ``min_bytes`` or more is kept and handed to the next request of about its size (up to 25%
larger, the most recently freed first: its bytes may still be in the CPU's cache). Two bounds keep the memory the
threshold was set for: a new block is never mapped while live + cached bytes would exceed the most ever live at
once (the least recently freed cached blocks are unmapped first), so the cache does not raise the peak resident
set; at most ``cap_bytes`` stay cached while unused; and :func:`trim`, once per optimizer step, unmaps what stayed
idle a whole step. New blocks of 2 MiB and more sit on transparent huge pages. Smaller requests go to c10's
allocator as before.

The allocator is registered once (``c10::SetCPUAllocator``) and stays: oneDNN frees its raw buffers through
whatever allocator is registered at the time. :func:`disable` empties the cache and stops caching.

``HF_ZERO_HOST_MALLOC=default`` (the opt-out of ``tune_host_malloc``) also leaves this cache off.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import torch

from hf_zero.ops._native import native_available

__all__ = ["HostCacheStats", "available", "enable", "disable", "empty_cache", "trim", "stats", "reset_peak",
           "DEFAULT_CAP_BYTES"]

# What the cache may hold unused. The peak rule (enable()) is what bounds it in training; the cap bounds what stays
# mapped when live memory falls far below its peak (after training, in evaluation). On the 32M Llama's ZeRO-3 step
# (benchmarks/bench_zero.py) 128 MiB still missed 61 of ~510 large requests a step; 256 MiB missed none.
DEFAULT_CAP_BYTES = 256 << 20


@dataclass(frozen=True)
class HostCacheStats:
    installed: bool       # registered as torch's CPU allocator (stays so once it was)
    caching: bool
    min_bytes: int
    cap_bytes: int
    live_bytes: int       # blocks of min_bytes and more in use by tensors
    cached_bytes: int     # kept for reuse
    peak_mapped_bytes: int  # most of live + cached at once since the last reset_peak()
    hits: int
    misses: int
    evictions: int


def available() -> bool:
    """Linux, and the compiled extension is loaded and has the cache (an older build does not)."""
    return sys.platform.startswith("linux") and native_available(torch.device("cpu")) and \
        hasattr(torch.ops.hf_zero, "host_cache_enable")


def enable(min_bytes: int, cap_bytes: int = DEFAULT_CAP_BYTES, headroom_bytes: int = 0, *,
           huge_pages: bool = True) -> bool:
    """Cache freed CPU blocks of ``min_bytes`` and more, keeping at most ``cap_bytes`` unused, and never mapping a
    new block while live + cached bytes exceed the most ever live at once plus ``headroom_bytes`` (the least
    recently freed cached blocks are unmapped first): with the default 0 the cache does not raise the peak resident
    set. Returns whether the cache is on: False off Linux, without the compiled extension, where the user opted
    out (``HF_ZERO_HOST_MALLOC=default``), or (with a warning saying why) where it could not be registered. A
    later call changes the numbers (a ZeRO-3 engine after a stage-2 one lowers ``min_bytes``). ``huge_pages``: new
    blocks of 2 MiB and more on transparent huge pages (see the C++ source's header)."""
    if os.environ.get("HF_ZERO_HOST_MALLOC", "").strip().lower() == "default" or not available():
        return False
    why_not = torch.ops.hf_zero.host_cache_enable(int(min_bytes), int(cap_bytes), int(headroom_bytes),
                                                  bool(huge_pages))
    if why_not:  # e.g. another library registered torch's CPU allocator above ours: train as before the cache
        warnings.warn(f"hf_zero: the host cache is off ({why_not}); CPU training runs without it", stacklevel=2)
        return False
    return True


def disable() -> None:
    """Empty the cache and stop caching (blocks freed from now on are unmapped at once)."""
    if available():
        torch.ops.hf_zero.host_cache_disable()


def empty_cache() -> None:
    """Unmap every cached block (caching goes on)."""
    if available():
        torch.ops.hf_zero.host_cache_empty()


def trim() -> None:
    """Unmap the cached blocks freed before the previous ``trim()`` and not reused since (the engine calls it once
    per optimizer step on CPU, so memory freed for good goes back to the kernel within two steps)."""
    if available():
        torch.ops.hf_zero.host_cache_trim()


def stats() -> HostCacheStats:
    values = torch.ops.hf_zero.host_cache_stats() if available() else [0] * 10
    installed, caching, *rest = values
    return HostCacheStats(bool(installed), bool(caching), *rest)


def reset_peak() -> None:
    """Start ``peak_mapped_bytes`` at what is mapped now; zero the hit, miss and eviction counts."""
    if available():
        torch.ops.hf_zero.host_cache_reset_peak()
