"""Per-rank swap files on an NVMe drive, read and written asynchronously with the ``aio`` op.

One :class:`SwapDir` per rank and per use (optimizer states, parameters): ``<nvme_path>/hf_zero-<kind>-rank<r>-
pid<p>/`` holding one preallocated file per named stream (``group0.exp_avg.swp``, ...). Reads and writes are
submitted to a small pool of background threads that run :func:`hf_zero.ops.aio.aio_read_` /
:func:`~hf_zero.ops.aio.aio_write` (which release the GIL), so they overlap each other and the optimizer math.

The directory is removed when the object is closed or collected, and at interpreter exit. Space is reserved with
``posix_fallocate`` when the files are created, so a full or unwritable ``nvme_path`` fails at start-up, naming the
path and the bytes needed, instead of half-way through a step.
"""

from __future__ import annotations

import os
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterable

import torch

from hf_zero.config.policies import AioParams
from hf_zero.ops.aio import aio_read_, aio_write

__all__ = ["AioParams", "SwapDir", "wait_all"]


def wait_all(futures: Iterable[Future]) -> None:
    """Wait for every read/write in ``futures``; the first failed one re-raises its I/O error (with the file)."""
    futures = list(futures)
    wait(futures)
    for f in futures:
        f.result()


def _remove(path: Path, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    shutil.rmtree(path, ignore_errors=True)


class SwapDir:
    """Named swap files of this rank under ``nvme_path``; see the module docstring."""

    def __init__(self, nvme_path: str | os.PathLike, *, kind: str, rank: int, sizes_nbytes: dict[str, int],
                 aio: AioParams, config_key: str = "zero_optimization.offload_optimizer"):
        root = Path(nvme_path)
        total = sum(sizes_nbytes.values())
        self.aio = aio
        self.path = root / f"hf_zero-{kind}-rank{rank}-pid{os.getpid()}"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"hf_zero: {config_key}.nvme_path={str(root)!r} is not a writable directory "
                                     f"({exc.strerror}); rank {rank} needs {total} bytes "
                                     f"({total / 2**30:.2f} GiB) there for swap files") from exc
        free = shutil.disk_usage(self.path).free
        if free < total:
            shutil.rmtree(self.path, ignore_errors=True)
            raise OSError(28, f"hf_zero: {config_key}.nvme_path={str(root)!r} has {free} bytes free; rank {rank} "
                              f"needs {total} bytes ({total / 2**30:.2f} GiB) for its swap files. Free space, "
                              f"point nvme_path at a larger drive, or offload less (offload_optimizer.ratio)")
        self.root, self.rank, self.config_key = root, rank, config_key
        self._files: dict[str, str] = {}
        self._nbytes: dict[str, int] = {}
        try:
            for name, nbytes in sizes_nbytes.items():
                self._create(name, nbytes)
        except OSError as exc:
            shutil.rmtree(self.path, ignore_errors=True)
            raise OSError(exc.errno, f"hf_zero: cannot create swap files in {config_key}.nvme_path={str(root)!r} "
                                     f"({exc.strerror}); rank {rank} needs {total} bytes "
                                     f"({total / 2**30:.2f} GiB) there") from exc
        self._pool = ThreadPoolExecutor(max_workers=aio.max_concurrent_ops, thread_name_prefix="hf_zero-aio")
        self._finalizer = weakref.finalize(self, _remove, self.path, self._pool)

    def _create(self, name: str, nbytes: int) -> None:
        file = str(self.path / f"{name}.swp")
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)  # reserved now: reads of unwritten ranges give zeros
        except OSError:
            os.unlink(file)  # nothing half-reserved is left behind
            raise
        finally:
            os.close(fd)
        self._files[name] = file
        self._nbytes[name] = nbytes

    def add(self, name: str, nbytes: int) -> None:
        """Create one more stream of ``nbytes`` (parameters swapped out one by one as a model is built)."""
        if name in self._files:
            raise ValueError(f"swap stream {name!r} exists already in {self.path}")
        try:
            self._create(name, nbytes)
        except OSError as exc:
            free = shutil.disk_usage(self.path).free
            raise OSError(exc.errno, f"hf_zero: cannot reserve {nbytes} bytes for {name!r} in {self.config_key}."
                                     f"nvme_path={str(self.root)!r} ({exc.strerror}); rank {self.rank} holds "
                                     f"{self.nbytes} bytes there already and {free} bytes are free. Free space "
                                     f"or point nvme_path at a larger drive") from exc

    def remove(self, name: str) -> None:
        """Delete one stream (its file and reservation)."""
        os.unlink(self._files.pop(name))
        del self._nbytes[name]

    @property
    def nbytes(self) -> int:
        """Bytes reserved on the drive by this rank's streams."""
        return sum(self._nbytes.values())

    def file(self, name: str) -> str:
        return self._files[name]

    def write_async(self, name: str, src: torch.Tensor, elem_offset: int) -> Future:
        """Write ``src`` (contiguous, CPU) into stream ``name`` at element ``elem_offset`` of src's dtype."""
        a = self.aio
        return self._pool.submit(aio_write, src, self._files[name], elem_offset * src.element_size(),
                                 block_size=a.block_size, queue_depth=a.queue_depth, thread_count=a.thread_count)

    def read_async(self, name: str, dst: torch.Tensor, elem_offset: int) -> Future:
        """Fill ``dst`` (contiguous, CPU) from stream ``name`` at element ``elem_offset`` of dst's dtype."""
        a = self.aio
        return self._pool.submit(aio_read_, dst, self._files[name], elem_offset * dst.element_size(),
                                 block_size=a.block_size, queue_depth=a.queue_depth, thread_count=a.thread_count)

    def file_nbytes(self) -> dict[str, int]:
        """Allocated size of every swap file (what the drive really holds for this rank)."""
        return {name: os.stat(f).st_size for name, f in self._files.items()}

    def close(self) -> None:
        """Wait for outstanding I/O and delete the swap directory."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
