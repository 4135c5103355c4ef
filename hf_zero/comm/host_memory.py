"""This process's memory as the CPU accelerator reports it: resident set size (RSS), and its peak.

On a CPU-only machine every tensor lives in process memory, so "allocated" is the resident set, as DeepSpeed's
CPU accelerator answers it. The peak is the kernel's own high-water mark (``VmHWM`` in ``/proc/self/status``,
which sees spikes between two calls), reset through ``/proc/self/clear_refs`` (Linux >= 4.0). Where either is
unavailable, the peak is the largest RSS seen by these functions since the last reset.
"""

from __future__ import annotations

import os

import psutil
import torch

__all__ = ["rss_bytes", "peak_rss_bytes", "reset_peak_rss", "tune_host_malloc", "mmap_threshold", "zero_and_release",
           "MALLOC_MMAP_THRESHOLD", "MALLOC_MMAP_THRESHOLD_STAGE3"]

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


# ---- glibc heap retention (docs/zero_memory.md) -------------------------------------------------------------------

# glibc serves a block below its mmap threshold from the heap and keeps it when freed; the threshold starts at 128 KiB
# but rises to the size of every mmapped block freed (up to 32 MiB), so after the first step almost every tensor of
# a small model comes from the heap. ZeRO frees and re-allocates gathered parameters, buckets and activations of many
# sizes every step, and the heap keeps the holes: measured on a 32M-parameter Llama (fp32, 2 ranks), malloc_trim
# handed back 0.56 GB per ZeRO-3 rank after a step, and a fixed 1 MiB threshold (blocks of 1 MiB and more from mmap,
# returned when freed) lowered the peak RSS per rank from 1296 to 958 MB at ZeRO-3 and from 1182 to 1019 MB at
# ZeRO-2 (benchmarks/bench_zero_memory.py --malloc-threshold 1048576).
#
# The price is time: every block above the threshold is a fresh mmap, each of its pages faulted in and zeroed by the
# kernel on first touch and unmapped on free -- activations and their gradients of every step, every gathered
# parameter at stage 3. On the same model (benchmarks/bench_zero.py, CPU time per step, which the load of the shared
# machine inflates far less than wall time; comm/buffer_pool.py already reusing the collectives' buffers):
#
#     threshold          ZeRO-2: CPU s  peak MB  faults/step    ZeRO-3: CPU s  peak MB  faults/step
#     1 MiB                      1.78     1073      211k                 2.22     1024      311k
#     2 MiB                      1.48     1143      113k                 1.88     1130      187k
#     4 MiB                      1.51     1170      104k                 1.79     1224      138k
#     glibc's default            1.37     1265       24k                 1.57     1368       19k
#
# So the threshold depends on the stage: ZeRO-3, whose point is memory and whose peak is within 0.8x DDP's only at
# 1 MiB, keeps 1 MiB; stages 0-2 take 2 MiB (hidden states of up to 2 MiB -- micro-batch x sequence x hidden x 4 B --
# stay in the heap), 17% less CPU per step for 70 MB.
MALLOC_MMAP_THRESHOLD = 2 << 20
MALLOC_MMAP_THRESHOLD_STAGE3 = 1 << 20
# The blocks under the threshold come from the heap, whose top glibc hands back as soon as 128 KiB of it are free
# (M_TRIM_THRESHOLD's default; fixing the mmap threshold also stops glibc from raising it) and grows again by what
# the next request needs: every step shrinks and regrows it, faulting the pages in again. ZeRO-3 (stage3_heap_top)
# keeps up to 32 MiB free at the top and grows it 16 MiB at a time: 146k -> 119k page faults per step on the 32M
# Llama for +14-23 MB peak (docs/zero_memory.md).
HEAP_TRIM_THRESHOLD_STAGE3 = 32 << 20
HEAP_TOP_PAD_STAGE3 = 16 << 20
_M_MMAP_THRESHOLD = -3  # mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_tuned: int | None = None  # the threshold set so far (None: not yet; 0: left to glibc or the user)


def tune_host_malloc(threshold: int = MALLOC_MMAP_THRESHOLD, *, stage3_heap_top: bool = False) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (:data:`MALLOC_MMAP_THRESHOLD` for stages 0-2,
    :data:`MALLOC_MMAP_THRESHOLD_STAGE3` for stage 3); from then on blocks that size and larger are mmapped. Once
    set, a later call only lowers it (a process training at stage 3 keeps stage 3's threshold).

    Not done where the user chose: ``MALLOC_MMAP_THRESHOLD_`` set in the environment (glibc already applied it), or
    ``HF_ZERO_HOST_MALLOC=default`` (the opt-out). ``HF_ZERO_HOST_MALLOC=<bytes>`` picks the threshold for every
    stage. A no-op off glibc. Returns whether the threshold was set (or lowered).

    ``stage3_heap_top``: also keep :data:`HEAP_TRIM_THRESHOLD_STAGE3` free at the top of the heap and grow it by
    :data:`HEAP_TOP_PAD_STAGE3` (each unless ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` is in the environment)."""
    global _tuned
    choice = os.environ.get("HF_ZERO_HOST_MALLOC", "").strip().lower()
    if choice == "default" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        _tuned = 0
        return False
    threshold = int(choice) if choice.isdigit() else int(threshold)
    if _tuned is not None and (_tuned == 0 or _tuned <= threshold):
        if _tuned and stage3_heap_top:
            _tune_heap_top()
        return False
    try:
        import ctypes

        done = bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)))
    except (OSError, AttributeError):
        done = False
    _tuned = threshold if done else 0
    if done and stage3_heap_top:
        _tune_heap_top()
    return done


def mmap_threshold() -> int | None:
    """The threshold :func:`tune_host_malloc` set: None before any call, 0 where it left glibc's (or the user's)."""
    return _tuned


_heap_top_tuned = False


def _tune_heap_top() -> None:
    global _heap_top_tuned
    if _heap_top_tuned:
        return
    _heap_top_tuned = True
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(HEAP_TRIM_THRESHOLD_STAGE3))
    if "MALLOC_TOP_PAD_" not in os.environ:
        libc.mallopt(_M_TOP_PAD, ctypes.c_int(HEAP_TOP_PAD_STAGE3))


# ---- zeroing by handing pages back ---------------------------------------------------------------------------------

_MADV_DONTNEED = 4  # madvise advice number (sys/mman.h)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc = None


def zero_and_release(t: torch.Tensor) -> None:
    """``t.zero_()`` for a contiguous CPU tensor, but the whole pages inside it are handed back to the kernel
    (``madvise(MADV_DONTNEED)``: private anonymous memory reads as zeros afterwards) instead of being written: they
    leave the resident set until something writes them again. ZeRO-3's gradient shard is zeroed after every step
    and then filled bucket by bucket during the next backward, so it costs resident memory only as its slices are
    reached -- not at the start of backward, where the activations make the peak. Elsewhere (other devices, no libc,
    small tensors) it is ``zero_()``."""
    global _libc
    nbytes = t.numel() * t.element_size()
    # shared memory would read back its file's bytes, pinned memory must keep its pages (pinning needs CUDA)
    if t.device.type != "cpu" or not t.is_contiguous() or nbytes < 16 * _PAGE or t.is_shared() or \
            torch.cuda.is_initialized():
        t.zero_()
        return
    start = t.data_ptr()
    lo = -(-start // _PAGE) * _PAGE
    hi = (start + nbytes) // _PAGE * _PAGE
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        failed = _libc.madvise(lo, hi - lo, _MADV_DONTNEED) != 0
    except (OSError, AttributeError):
        failed = True
    if failed:
        t.zero_()
        return
    flat = t.view(-1).view(torch.uint8)  # the partial pages at both ends are written
    flat[:lo - start].zero_()
    flat[hi - start:].zero_()
