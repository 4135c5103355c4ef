"""A small cache of the large transient buffers of hf_zero's collectives (packed buckets, gather buffers).

Why: with glibc's mmap threshold fixed at 1 MiB (host_memory.tune_host_malloc, for the memory it hands back),
every buffer of a MiB or more is a fresh mmap, and every page of it is faulted in and zeroed by the kernel on first
touch -- then unmapped when freed, a TLB shootdown on every core the process runs on. ZeRO allocates such buffers
for every bucket and every gather of every step (about 0.6 GB per step per rank for the 32M Llama at stage 3,
benchmarks/bench_zero.py counts the faults). The sizes repeat from step to step (fixed buckets, the same modules),
so keeping a few freed buffers and handing them out again removes those faults, at the cost of at most
:data:`POOL_CAP_BYTES` kept between uses -- buffers that exist in flight anyway during backward, where the peak is.

Only the caller knows when a buffer is free: :func:`give` a buffer only once nothing reads or writes it any more
(its collective waited, its values copied out) and no view of it escapes. A buffer that is never given back is
simply freed by Python as before.
"""

from __future__ import annotations

import threading

import torch

from .buckets import BUCKET_CAP_BYTES

__all__ = ["take", "give", "clear", "cached_bytes", "POOL_CAP_BYTES", "MIN_POOLED_BYTES"]

# Two buckets at the cap: what overlap keeps in flight during backward anyway. Buffers kept here while nothing uses
# them count in the peak RSS (ZeRO-3's peak is in backward): 4 buckets' worth added ~55 MB to it on the 32M Llama.
POOL_CAP_BYTES = 2 * BUCKET_CAP_BYTES
# Below glibc's (fixed) mmap threshold buffers come from the heap, which reuses them without faults.
MIN_POOLED_BYTES = 1 << 20
# A cached buffer serves a request of at least this fraction of its size: gathers and buckets differ in size, and a
# buffer kept for one while the other kind runs (forward gathers, backward buckets) would be dead weight.
_FIT = 0.5

_lock = threading.Lock()
_free: list[torch.Tensor] = []  # flat, contiguous, most recently given last
_cached = 0


def take(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized contiguous tensor of ``shape``: a cached buffer that fits, else a new one."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for d in shape:
        numel *= int(d)
    nbytes = numel * dtype.itemsize
    device = torch.device(device)
    if nbytes >= MIN_POOLED_BYTES and device.type == "cpu":
        global _cached
        with _lock:
            best = None
            for i in range(len(_free) - 1, -1, -1):
                t = _free[i]
                have = t.numel() * t.element_size()
                if t.dtype == dtype and have >= nbytes and nbytes >= _FIT * have and \
                        (best is None or have < _free[best].numel() * _free[best].element_size()):
                    best = i
            if best is not None:
                t = _free.pop(best)
                _cached -= t.numel() * t.element_size()
                return t[:numel].view(shape)
    return torch.empty(shape, dtype=dtype, device=device)


def give(t: torch.Tensor | None) -> None:
    """``t`` (from :func:`take` or any contiguous buffer nothing else uses now) may serve a later :func:`take`."""
    global _cached
    if t is None or t.device.type != "cpu" or t.requires_grad:
        return
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes < MIN_POOLED_BYTES or nbytes > POOL_CAP_BYTES:
        return
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (nbytes // t.element_size(),))
    with _lock:
        if any(f.untyped_storage().data_ptr() == storage.data_ptr() for f in _free):
            return  # given twice
        _free.append(flat)
        _cached += nbytes
        while _cached > POOL_CAP_BYTES:  # drop the oldest
            old = _free.pop(0)
            _cached -= old.numel() * old.element_size()


def clear() -> None:
    """Free every cached buffer (tests; the end of training)."""
    global _cached
    with _lock:
        _free.clear()
        _cached = 0


def cached_bytes() -> int:
    return _cached
