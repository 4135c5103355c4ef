"""Block-parallel file I/O for NVMe offload: ``aio_write`` / ``aio_read_`` and their pure-Python reference.

Each call moves one contiguous CPU tensor to or from ``[file_offset, file_offset + nbytes)`` of a file, cut into
``block_size``-byte requests of which ``queue_depth * thread_count`` are in flight at once. The compiled kernels
(``csrc/aio/aio_cpu.cpp``) use POSIX pread/pwrite from a pool of worker threads and release the GIL, so a
background thread can run them while Python keeps computing (:mod:`hf_zero.offload.swapper` does that). The
reference does the same with ``os.pread`` / ``os.pwrite`` in a ``ThreadPoolExecutor``.

Both return the number of bytes moved and raise ``OSError``/``RuntimeError`` naming the file on failure.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from hf_zero.ops._native import native_available, warn_fallback

__all__ = ["aio_read_", "aio_read_reference_", "aio_write", "aio_write_reference"]


def _bytes_view(buffer: torch.Tensor):
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError(f"aio: buffer must be a contiguous CPU tensor, got device={buffer.device} "
                         f"contiguous={buffer.is_contiguous()}")
    return memoryview(buffer.view(-1).view(torch.uint8).numpy())


def _blocks(nbytes: int, block_size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + block_size, nbytes)) for lo in range(0, nbytes, block_size)]


def _run_blocks(fn, nbytes: int, block_size: int, workers: int) -> None:
    blocks = _blocks(nbytes, block_size)
    if workers <= 1 or len(blocks) <= 1:
        for lo, hi in blocks:
            fn(lo, hi)
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(blocks))) as pool:
        for f in [pool.submit(fn, lo, hi) for lo, hi in blocks]:
            f.result()


def aio_write_reference(buffer: torch.Tensor, path: str, file_offset: int = 0, *, block_size: int = 1 << 20,
                        queue_depth: int = 8, thread_count: int = 1) -> int:
    """Pure-Python reference of :func:`aio_write`."""
    data = _bytes_view(buffer)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        def write(lo: int, hi: int) -> None:
            done = lo
            while done < hi:
                done += os.pwrite(fd, data[done:hi], file_offset + done)

        _run_blocks(write, len(data), block_size, queue_depth * thread_count)
    finally:
        os.close(fd)
    return len(data)


def aio_read_reference_(buffer: torch.Tensor, path: str, file_offset: int = 0, *, block_size: int = 1 << 20,
                        queue_depth: int = 8, thread_count: int = 1) -> int:
    """Pure-Python reference of :func:`aio_read_`."""
    data = _bytes_view(buffer)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        def read(lo: int, hi: int) -> None:
            done = lo
            while done < hi:
                n = os.preadv(fd, [data[done:hi]], file_offset + done)
                if n == 0:
                    raise OSError(f"aio_pread: {path}: unexpected end of file at byte {file_offset + done}")
                done += n

        _run_blocks(read, len(data), block_size, queue_depth * thread_count)
    finally:
        os.close(fd)
    return len(data)


def _native() -> bool:
    """Compiled kernels loaded *and* built with csrc/aio (an extension built before it existed lacks them)."""
    return native_available("cpu") and hasattr(torch.ops.hf_zero, "aio_pwrite")


def aio_write(buffer: torch.Tensor, path: str | os.PathLike, file_offset: int = 0, *, block_size: int = 1 << 20,
              queue_depth: int = 8, thread_count: int = 1) -> int:
    """Write ``buffer``'s bytes to ``path`` at ``file_offset`` (the file is created if missing)."""
    path = os.fspath(path)
    if _native():
        return int(torch.ops.hf_zero.aio_pwrite(buffer, path, int(file_offset), int(block_size), int(queue_depth),
                                                int(thread_count)))
    warn_fallback("aio_pwrite", "cpu")
    return aio_write_reference(buffer, path, file_offset, block_size=block_size, queue_depth=queue_depth,
                               thread_count=thread_count)


def aio_read_(buffer: torch.Tensor, path: str | os.PathLike, file_offset: int = 0, *, block_size: int = 1 << 20,
              queue_depth: int = 8, thread_count: int = 1) -> int:
    """Fill ``buffer`` in place from ``path`` at ``file_offset``."""
    path = os.fspath(path)
    if _native():
        return int(torch.ops.hf_zero.aio_pread(buffer, path, int(file_offset), int(block_size), int(queue_depth),
                                               int(thread_count)))
    warn_fallback("aio_pread", "cpu")
    return aio_read_reference_(buffer, path, file_offset, block_size=block_size, queue_depth=queue_depth,
                               thread_count=thread_count)
