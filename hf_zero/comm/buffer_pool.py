"""A small cache of the large transient buffers of hf_zero's collectives (packed buckets, gather buffers) and, at
ZeRO-3, of its gathered parameters and of the gradients it has packed.

Why: with glibc's mmap threshold fixed at 1 MiB (host_memory.tune_host_malloc, for the memory it hands back),
every buffer of a MiB or more is a fresh mmap, and every page of it is faulted in and zeroed by the kernel on first
touch -- then unmapped when freed, a TLB shootdown on every core the process runs on. ZeRO allocates such buffers
for every bucket and every gather of every step (about 0.6 GB per step per rank for the 32M Llama at stage 3,
benchmarks/bench_zero.py counts the faults). The sizes repeat from step to step (fixed buckets, the same modules),
so keeping a few freed buffers and handing them out again removes those faults, at the cost of at most
:data:`POOL_CAP_BYTES` kept between uses -- buffers that exist in flight anyway during backward, where the peak is.

Only the caller knows when a buffer is free: :func:`give` a buffer only once nothing reads or writes it any more
(its collective waited, its values copied out) and no view of it escapes; :func:`give_if_unshared` checks the
last part itself (a released parameter may still be viewed by autograd). A buffer that is never given back is
simply freed by Python as before. Buffers are kept as bytes: any dtype may take one.

:func:`release_storage` / :func:`refill_storage` move the bytes of a storage out and back without changing which
storage it is: ZeRO-3 parks a parameter released in forward that way (autograd's saved views of the weight keep
pointing at the storage; the backward's gather refills it), so parking hands the bytes to the next gather instead
of to the kernel.
"""

from __future__ import annotations

import threading

import torch

from .buckets import BUCKET_CAP_BYTES

__all__ = ["take", "give", "give_if_unshared", "refill_storage", "release_storage", "raise_cap", "cap_bytes", "clear",
           "cached_bytes", "POOL_CAP_BYTES", "POOL_CAP_BYTES_STAGE3", "MIN_POOLED_BYTES"]

# Two buckets at the cap: what overlap keeps in flight during backward anyway. Buffers kept here while nothing uses
# them count in the peak RSS (ZeRO-3's peak is in backward): 4 buckets' worth added ~55 MB to it on the 32M Llama.
POOL_CAP_BYTES = 2 * BUCKET_CAP_BYTES
# ZeRO-3 also keeps its gathered parameters' and packed gradients' buffers here (zero/stage3), a working set of
# several modules' parameters: with 32 MiB half the takes of a 32M-Llama step missed (~120k page faults per step).
# 64 MiB halves the misses for ~25 MB more peak (benchmarks/RESULTS_history.md); raised by the ZeRO-3 runtime only.
POOL_CAP_BYTES_STAGE3 = 4 * BUCKET_CAP_BYTES
# Below glibc's (fixed) mmap threshold buffers come from the heap, which reuses them without faults.
MIN_POOLED_BYTES = 1 << 20
# A cached buffer serves a request of at least this fraction of its size: gathers and buckets differ in size, and a
# buffer kept for one while the other kind runs (forward gathers, backward buckets) would be dead weight.
_FIT = 0.5

# torch's storage internals used to move bytes between storages without copying (guarded: absent, the plain resize
# and free paths are taken). A storage's use count is one per tensor on it plus one for the wrapper asked about it.
_swap = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
_use_count = getattr(torch._C, "_storage_Use_Count", None)
_SOLE_OWNER_USES = 2

_lock = threading.Lock()
_cap = POOL_CAP_BYTES
_free: list[torch.Tensor] = []  # flat uint8 over a whole storage, most recently given last
_cached = 0


def take(shape, dtype: torch.dtype, device, *, fit: float | None = None) -> torch.Tensor:
    """An uninitialized contiguous tensor of ``shape``: a cached buffer that fits, else a new one. ``fit``: the
    smallest fraction of a cached buffer the request may use (default :data:`_FIT`); the tensor's storage is the
    whole buffer, so a buffer that outlives the request (a gathered parameter) asks for a tighter fit."""
    fit = _FIT if fit is None else fit
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
                have = _free[i].numel()
                if have >= nbytes and nbytes >= fit * have and (best is None or have < _free[best].numel()):
                    best = i
            if best is not None:
                t = _free.pop(best)
                _cached -= t.numel()
                return t[:nbytes].view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype, device=device)


def give(t: torch.Tensor | None) -> None:
    """``t`` (from :func:`take` or any contiguous buffer nothing else uses now) may serve a later :func:`take`."""
    global _cached
    if t is None or t.device.type != "cpu" or t.requires_grad:
        return
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes < MIN_POOLED_BYTES or nbytes > _cap:
        return
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (nbytes,))  # any dtype may take it
    with _lock:
        if any(f.untyped_storage().data_ptr() == storage.data_ptr() for f in _free):
            return  # given twice
        _free.append(flat)
        _cached += nbytes
        while _cached > _cap:  # drop the oldest
            old = _free.pop(0)
            _cached -= old.numel()


def give_if_unshared(t: torch.Tensor | None) -> bool:
    """:func:`give` ``t`` if no other tensor shares its storage (no view saved by autograd, no alias): a buffer whose
    owner cannot tell whether it escaped (a released gathered parameter, a gradient already packed). Returns whether
    it was given."""
    if t is None or t.device.type != "cpu" or t.requires_grad or _use_count is None:
        return False
    if _use_count(t.untyped_storage()._cdata) > _SOLE_OWNER_USES:
        return False
    give(t)
    return True


def release_storage(t: torch.Tensor) -> None:
    """Free the bytes of ``t``'s storage in place (its views stay valid objects, holding nothing) and keep them here
    for a later :func:`take` or :func:`refill_storage`: what ``t.untyped_storage().resize_(0)`` does, without handing
    a freshly mmapped block back to the kernel only to fault a new one in for the next buffer."""
    storage = t.untyped_storage()
    if _swap is None or storage.nbytes() < MIN_POOLED_BYTES or t.device.type != "cpu":
        storage.resize_(0)
        return
    holder = torch.empty(0, dtype=torch.uint8)
    _swap(storage, holder.untyped_storage())  # storage <-> holder: storage now empty, holder owns the bytes
    give(holder)  # kept, or freed here when the pool is full


def refill_storage(t: torch.Tensor, *, fit: float | None = None) -> None:
    """Give ``t``'s emptied storage (:func:`release_storage`) ``t.numel()`` elements again (uninitialized), from a
    kept buffer where one fits: views of ``t`` saved meanwhile see the new bytes."""
    storage = t.untyped_storage()
    nbytes = (t.storage_offset() + t.numel()) * t.element_size()
    if storage.nbytes() >= nbytes:
        return
    if _swap is None or storage.nbytes() != 0 or t.device.type != "cpu":
        storage.resize_(nbytes)
        return
    buf = take(-(-nbytes // t.element_size()), t.dtype, t.device, fit=fit)
    _swap(storage, buf.untyped_storage())  # buf's storage (whole, maybe larger) moves into t's


def raise_cap(nbytes: int) -> None:
    """Keep up to ``nbytes`` from now on (a cap is only ever raised: the process's largest user sets it)."""
    global _cap
    _cap = max(_cap, int(nbytes))


def cap_bytes() -> int:
    return _cap


def clear() -> None:
    """Free every cached buffer (tests; the end of training)."""
    global _cached
    with _lock:
        _free.clear()
        _cached = 0


def cached_bytes() -> int:
    return _cached
