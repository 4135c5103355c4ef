"""How a CPU training process manages host memory: one call per engine / zero.Init, for every stage.

Two pieces, each documented where it lives: glibc's mmap threshold fixed so freed tensors go back to the kernel
(``hf_zero.comm.host_memory.tune_host_malloc``: 1 MiB at ZeRO-3, 2 MiB below), and the large-block cache of torch's
CPU allocator (``hf_zero.ops.host_cache``), which keeps the blocks of that size and more that a training step frees
and allocates again every iteration, instead of faulting fresh pages in each time. The cache takes the threshold as
its lower bound: below it glibc's heap already reuses blocks without faults.
"""

from __future__ import annotations

import os

from hf_zero.comm.host_memory import MALLOC_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD_STAGE3, mmap_threshold, \
    tune_host_malloc
from hf_zero.ops import host_cache
from hf_zero.util.env import env_flag

__all__ = ["tune_cpu_training_memory", "HOST_CACHE_CAP_ENV", "HOST_CACHE_HUGE_PAGES_ENV"]

HOST_CACHE_CAP_ENV = "HF_ZERO_HOST_CACHE_BYTES"  # what the cache may keep unused; 0 turns it off
HOST_CACHE_HUGE_PAGES_ENV = "HF_ZERO_HOST_CACHE_HUGE_PAGES"  # 0: the cache's blocks on ordinary 4 KiB pages


def tune_cpu_training_memory(*, stage3: bool) -> None:
    """Called where CPU training starts (the engine at any stage; ZeRO-3's runtime and zero.Init)."""
    if stage3:
        tune_host_malloc(MALLOC_MMAP_THRESHOLD_STAGE3, stage3_heap_top=True)
    else:
        tune_host_malloc(MALLOC_MMAP_THRESHOLD)
    threshold = mmap_threshold()
    if not threshold:  # the user chose glibc's behaviour (HF_ZERO_HOST_MALLOC=default, MALLOC_MMAP_THRESHOLD_)
        return
    cap = os.environ.get(HOST_CACHE_CAP_ENV, "").strip()
    if cap:
        if not cap.isdigit():
            raise ValueError(f"{HOST_CACHE_CAP_ENV}={cap!r}: expected a number of bytes (0 turns the cache off)")
        if int(cap) == 0:
            host_cache.disable()
            return
    host_cache.enable(threshold, int(cap) if cap else host_cache.DEFAULT_CAP_BYTES,
                      huge_pages=env_flag(HOST_CACHE_HUGE_PAGES_ENV, True))
