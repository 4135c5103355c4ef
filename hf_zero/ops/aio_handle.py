"""DeepSpeed's ``aio_handle`` (``AsyncIOBuilder().load().aio_handle(...)``) over hf_zero's aio op.

DeepSpeed users and its NVMe swap code drive file I/O through a handle: synchronous ``sync_pread`` /
``sync_pwrite``, asynchronous ``async_pread`` / ``async_pwrite`` completed by ``wait()``. Here each call is one
:func:`~hf_zero.ops.aio.aio_read_` / :func:`~hf_zero.ops.aio.aio_write` (``block_size`` requests,
``queue_depth * intra_op_parallelism`` of them in flight), run on the handle's one background thread: the ops
release the GIL, so an async op overlaps the caller's work, and ops complete in the order they were submitted.

Return values are DeepSpeed's: a synchronous call returns the number of operations it completed (1, plus any async
ones still pending, which it waits for first -- as DeepSpeed's handle does); an asynchronous one returns 0 and
``wait()`` the number completed since the last wait. Where DeepSpeed returns -1 and prints, this raises
``OSError`` naming the file (a short file, a missing one): a -1 that a script does not check is data silently not
read. ``single_submit`` and ``overlap_events`` choose libaio submission modes; there is no libaio here, so they are
kept (the getters return them) and change nothing.
"""

from __future__ import annotations

import os
import types
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hf_zero.ops.aio import aio_read_, aio_write

__all__ = ["AioHandle", "AsyncIOBuilder"]


class AioHandle:
    """DeepSpeed's ``aio_handle(block_size=1 MiB, queue_depth=128, single_submit=False, overlap_events=False,
    intra_op_parallelism=1)``; ``num_threads`` is the fifth argument's name in DeepSpeed 0.15."""

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1, *, num_threads: int | None = None):
        if num_threads is not None:
            intra_op_parallelism = num_threads
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("intra_op_parallelism", intra_op_parallelism)):
            if int(value) < 1:
                raise ValueError(f"aio_handle: {name} must be >= 1, got {value}")
        self._block_size, self._queue_depth = int(block_size), int(queue_depth)
        self._single_submit, self._overlap_events = bool(single_submit), bool(overlap_events)
        self._threads = int(intra_op_parallelism)
        # one worker: ops run in submission order (a write then a read of the same file reads what was written)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-aio-handle")
        weakref.finalize(self, self._pool.shutdown, wait=True)
        self._pending: list[Future] = []

    # the configuration, as DeepSpeed's getters report it
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._threads

    get_thread_count = get_intra_op_parallelism  # DeepSpeed <= 0.14's name

    def get_alignment(self) -> int:
        return self._block_size  # DeepSpeed: the O_DIRECT alignment; buffered I/O here has none beyond a block

    # I/O
    def sync_pread(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, False, True, file_offset)

    def read(self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool, file_offset: int = 0) -> int:
        """DeepSpeed's non-parallel synchronous read; returns 0 as DeepSpeed's does."""
        self.pread(buffer, filename, validate, False, file_offset)
        return 0

    def write(self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool, file_offset: int = 0) -> int:
        self.pwrite(buffer, filename, validate, False, file_offset)
        return 0

    def pread(self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool, async_op: bool,
              file_offset: int = 0) -> int:
        """Fill ``buffer`` from ``filename`` at ``file_offset`` (``async`` is DeepSpeed's name for ``async_op``,
        a keyword Python reserves: pass it positionally)."""
        path = os.fspath(filename)
        return self._submit(lambda: self._read(buffer, path, file_offset, validate), async_op)

    def pwrite(self, buffer: torch.Tensor, filename: str | os.PathLike, validate: bool, async_op: bool,
               file_offset: int = 0) -> int:
        """Write ``buffer`` into ``filename`` at ``file_offset`` (created if missing, never truncated)."""
        path = os.fspath(filename)
        return self._submit(lambda: self._write(buffer, path, file_offset, validate), async_op)

    def wait(self) -> int:
        """Wait for every pending asynchronous op; returns how many completed. The first failure is raised after
        all of them finished (no op is left running on a buffer the caller may free)."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return len(pending)

    # pinned host buffers (DeepSpeed's bounce buffers for GPU tensors)
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(int(num_elem), dtype=example_tensor.dtype, pin_memory=torch.cuda.is_available())

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return True  # torch owns the memory: it is freed with the last reference

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        return buffer.device.type == "cpu" and buffer.is_pinned()

    # internals
    def _submit(self, op, async_op: bool) -> int:
        self._pending.append(self._pool.submit(op))
        return 0 if async_op else self.wait()

    def _kwargs(self) -> dict:
        return {"block_size": self._block_size, "queue_depth": self._queue_depth, "thread_count": self._threads}

    def _read(self, buffer: torch.Tensor, path: str, file_offset: int, validate: bool) -> None:
        # the size is checked here, on the worker, after the ops submitted before this one (a pending write may
        # be what makes the file long enough)
        nbytes = buffer.numel() * buffer.element_size()
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise OSError(exc.errno, f"aio_handle.pread: cannot read {path!r}: {exc.strerror}") from None
        if size - file_offset < nbytes:
            raise OSError(f"aio_handle.pread: {path!r} has {size} bytes; reading {nbytes} bytes at offset "
                          f"{file_offset} needs {file_offset + nbytes}")
        host = _host(buffer)
        aio_read_(host, path, file_offset, **self._kwargs())
        if host is not buffer:
            buffer.copy_(host)
        if validate:
            _validate(host, path, file_offset, "read")

    def _write(self, buffer: torch.Tensor, path: str, file_offset: int, validate: bool) -> None:
        host = _host(buffer, copy=True)
        aio_write(host, path, file_offset, **self._kwargs())
        if validate:
            _validate(host, path, file_offset, "write")


def _host(buffer: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """``buffer`` itself where the op can use it (contiguous, in host memory), else a host copy (a GPU tensor goes
    through host memory, as DeepSpeed's bounce buffer)."""
    if buffer.device.type == "cpu" and buffer.is_contiguous():
        return buffer
    host = torch.empty(buffer.shape, dtype=buffer.dtype)
    if copy:
        host.copy_(buffer)
    return host


def _validate(host: torch.Tensor, path: str, file_offset: int, what: str) -> None:
    """DeepSpeed's ``validate=True``: the bytes in the file equal the buffer's, read back with plain file I/O."""
    data = host.reshape(-1).view(torch.uint8).numpy().tobytes()
    with open(path, "rb") as f:
        f.seek(file_offset)
        on_disk = f.read(len(data))
    if on_disk != data:
        raise OSError(f"aio_handle: validation of the {what} of {len(data)} bytes at offset {file_offset} of "
                      f"{path!r} failed: the file's bytes differ from the buffer's")


class AsyncIOBuilder:
    """DeepSpeed's op builder for the aio op: ``load()`` returns a module with ``aio_handle``. Nothing is compiled
    at first use: the op was built with hf_zero (or its pure-Python reference runs, with a warning, if not)."""

    NAME = "async_io"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True  # POSIX pread/pwrite, no libaio

    def load(self, verbose: bool = False) -> types.ModuleType:
        return _OP_MODULE

    def absolute_name(self) -> str:
        return f"deepspeed.ops.aio.{self.NAME}_op"


# what DeepSpeed's compiled async_io op module offers scripts: the handle class
_OP_MODULE = types.ModuleType("async_io_op", "hf_zero's aio op with DeepSpeed's aio_handle interface")
_OP_MODULE.aio_handle = AioHandle
