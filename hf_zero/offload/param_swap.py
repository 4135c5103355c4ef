"""``offload_param: {device: nvme}``: ZeRO-3 shards kept in per-rank swap files instead of memory.

A swapped :class:`~hf_zero.zero.stage3.ShardedParam` holds its values through a :class:`SwappedShard`, the swapped
implementation of zero's ``ShardStorage`` interface (hf_zero/zero/stage3/storage.py): one stream per parameter in
the :class:`ParamSwapper`'s directory (``p<ds_id>``, ``shard_numel`` elements). This module knows keys, dtypes and
element counts, never a ShardedParam::

    built (zero.Init) -> sp.to_swapped(swapper): the shard is written to p<id>, the resident copy dropped
    gather            -> read p<id> straight into the all-gather's send buffer (or take a finished read-ahead)
    optimizer step    -> the updated 16-bit values of each tile are written back to p<id>
    cast (bf16 run)   -> p<id> is rewritten in the compute dtype; the fp32 values it was built with move to
                         p<id>.init, read once to build the fp32 master weights, deleted after the first step

Why one stream per parameter rather than one file per optimizer group: parameters are swapped out while the model
is being built, before any group exists, and a parameter is the unit every reader asks for (a module's gather).

Read-ahead: the stage-3 runtime knows which modules come next (its recorded trace) and asks for their shards
early with :meth:`ParamSwapper.read_ahead` (given their storages); a gather then only copies from the finished
buffer. Read-aheads are dropped before the optimizer writes new values (:meth:`ParamSwapper.discard_read_ahead`),
so none is ever stale. Memory stays bounded: resident are only the read-ahead buffers (the runtime bounds them by
``stage3_prefetch_bucket_size``) and the gathered modules themselves.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, wait
from typing import Iterable

import torch

from hf_zero.offload.swapper import AioParams, SwapDir, wait_all
from hf_zero.profiling.timers import NO_TIMERS

__all__ = ["ParamSwapper", "SwappedShard", "param_swapper_for"]

CONFIG_KEY = "zero_optimization.offload_param"


class _Done(Future):
    """A finished Future: a read served from a read-ahead buffer needs no waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.set_result(None)


class SwappedShard:
    """One shard's values in a ParamSwapper's stream ``key``: zero's ``ShardStorage``, swapped."""

    swapped = True

    def __init__(self, swapper: "ParamSwapper", key: str, numel: int, dtype: torch.dtype) -> None:
        self.swapper, self.key, self.numel = swapper, key, numel
        self._local = torch.empty(0, dtype=dtype)  # what ds_tensor shows: nothing resident, the shard's dtype

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        return self._local.device

    @property
    def local(self) -> torch.Tensor:
        return self._local

    def values(self) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=self.dtype)
        self.swapper.read(self.key, out)
        return out

    def read_async(self, out: torch.Tensor, lo: int = 0) -> Future:
        return self.swapper.read_async(self.key, out, lo)

    def write_async(self, values: torch.Tensor, lo: int = 0) -> Future:
        return self.swapper.write_async(self.key, values.to(self.dtype), lo)

    def read_initial_fp32(self, out: torch.Tensor, lo: int = 0) -> None:
        self.swapper.read_initial(self.key, self.dtype, out, lo)

    def cast(self, dtype: torch.dtype) -> None:
        if dtype != self.dtype:
            self.swapper.cast(self.key, self.numel, self.dtype, dtype)
            self._local = torch.empty(0, dtype=dtype)

    def drop_initial(self) -> None:
        self.swapper.drop_initial(self.key)

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.swapper.take(self.key, self.numel, self.dtype)

    def rebind(self, view: torch.Tensor, *, copy: bool = True) -> None:
        raise ValueError("the shard is in a swap file (offload_param nvme); it has no storage to move")


class ParamSwapper:
    """This rank's swapped ZeRO-3 shards under ``nvme_path``, one stream per key; see the module docstring.
    Implements zero's ``ShardStore``: :meth:`store` turns resident values into a :class:`SwappedShard`."""

    def __init__(self, nvme_path: str | os.PathLike, *, rank: int, aio: AioParams) -> None:
        self.nvme_path = os.fspath(nvme_path)
        self.dir = SwapDir(nvme_path, kind="params", rank=rank, sizes_nbytes={}, aio=aio, config_key=CONFIG_KEY)
        self.timers = NO_TIMERS  # the engine's: waiting for a shard's read counts as "offload_io"
        self._ahead: dict[str, tuple[torch.Tensor, Future]] = {}  # key -> (buffer, read in flight)
        self._initial: set[str] = set()  # keys with a <key>.init stream (fp32 values before the cast)
        self.read_numel = 0  # statistics: elements read from and written to the drive
        self.written_numel = 0
        self.ahead_hits = 0  # reads served from a finished (or in-flight) read-ahead

    # ------------------------------------------------------------------ placement
    def store(self, key: str, values: torch.Tensor, initial_fp32: torch.Tensor | None, *,
              label: str) -> SwappedShard:
        """Write ``values`` (and the fp32 original, if they were cast) to the streams of ``key``."""
        if values.device.type != "cpu":
            raise ValueError(f"{label}: offload_param swaps CPU shards; this one is on {values.device}")
        self.dir.add(key, values.numel() * values.element_size())
        futures = [self.dir.write_async(key, values.contiguous(), 0)]
        if initial_fp32 is not None:
            self.dir.add(key + ".init", values.numel() * 4)
            futures.append(self.dir.write_async(key + ".init", initial_fp32.contiguous(), 0))
            self._initial.add(key)
        wait_all(futures)
        self.written_numel += values.numel()
        return SwappedShard(self, key, values.numel(), values.dtype)

    def take(self, key: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The opposite of :meth:`store`: the values (and fp32 original) back in memory, the streams removed."""
        values = self._read_new(key, numel, dtype)
        initial = None
        if key in self._initial:
            initial = torch.empty(numel, dtype=torch.float32)
            self.read_initial(key, dtype, initial)
            self.drop_initial(key)
        self.dir.remove(key)
        return values, initial

    def cast(self, key: str, numel: int, old: torch.dtype, dtype: torch.dtype) -> None:
        """Rewrite stream ``key`` in ``dtype``; the first cast keeps the fp32 values as the ``.init`` stream."""
        self._drop_ahead(key)
        values = self._read_new(key, numel, old)
        if key not in self._initial:
            self.dir.add(key + ".init", numel * 4)
            wait_all([self.dir.write_async(key + ".init", values.float().contiguous(), 0)])
            self._initial.add(key)
        self.dir.remove(key)
        self.dir.add(key, numel * torch.empty(0, dtype=dtype).element_size())
        wait_all([self.dir.write_async(key, values.to(dtype).contiguous(), 0)])

    # ------------------------------------------------------------------ values
    def read_async(self, key: str, out: torch.Tensor, lo: int = 0) -> Future:
        """Fill ``out`` with elements ``[lo, lo + out.numel())`` of stream ``key``."""
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            buf, fut = ahead
            self.ahead_hits += 1
            with self.timers.phase("offload_io"):
                fut.result()
            out.copy_(buf[lo:lo + out.numel()])
            return _Done()
        self.read_numel += out.numel()
        return self.dir.read_async(key, out, lo)

    def read(self, key: str, out: torch.Tensor, lo: int = 0) -> None:
        with self.timers.phase("offload_io"):
            self.read_async(key, out, lo).result()

    def write_async(self, key: str, values: torch.Tensor, lo: int = 0) -> Future:
        """Store ``values`` (already in the stream's dtype) as elements ``[lo, lo + values.numel())``."""
        self._drop_ahead(key)
        self.written_numel += values.numel()
        return self.dir.write_async(key, values.contiguous(), lo)

    def read_initial(self, key: str, dtype: torch.dtype, out: torch.Tensor, lo: int = 0) -> None:
        """Elements ``[lo, lo + out.numel())`` of the fp32 values stream ``key`` was stored with (``out`` fp32);
        ``dtype`` is the stream's current dtype."""
        if key in self._initial:
            with self.timers.phase("offload_io"):
                self.dir.read_async(key + ".init", out, lo).result()
        elif dtype == torch.float32:
            self.read(key, out, lo)
        else:
            tmp = torch.empty(out.numel(), dtype=dtype)
            self.read(key, tmp, lo)
            out.copy_(tmp)

    def drop_initial(self, key: str) -> None:
        if key in self._initial:
            self._initial.discard(key)
            self.dir.remove(key + ".init")

    # ------------------------------------------------------------------ read-ahead
    def read_ahead(self, storages: Iterable) -> int:
        """Start reading the shards of those ``storages`` this swapper holds into buffers of their own; returns
        the elements newly requested. Resident storages are skipped: they need no read."""
        numel = 0
        for st in storages:
            if isinstance(st, SwappedShard) and st.swapper is self and st.key not in self._ahead:
                buf = torch.empty(st.numel, dtype=st.dtype)
                self._ahead[st.key] = (buf, self.dir.read_async(st.key, buf, 0))
                numel += st.numel
                self.read_numel += st.numel
        return numel

    def discard_read_ahead(self) -> None:
        """Drop every read-ahead (before new values are written). Waits for the reads still in flight."""
        ahead, self._ahead = self._ahead, {}
        wait([fut for _, fut in ahead.values()])

    @property
    def read_ahead_numel(self) -> int:
        return sum(buf.numel() for buf, _ in self._ahead.values())

    # ------------------------------------------------------------------ accounting
    @property
    def nbytes(self) -> int:
        """Bytes of swap files this rank holds on the drive."""
        return self.dir.nbytes

    def close(self) -> None:
        self.discard_read_ahead()
        self.dir.close()
        if _SWAPPERS.get(self.nvme_path) is self:
            del _SWAPPERS[self.nvme_path]

    # ------------------------------------------------------------------ helpers
    def _drop_ahead(self, key: str) -> None:
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            ahead[1].result()

    def _read_new(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        self.read(key, out)
        return out


_SWAPPERS: dict[str, ParamSwapper] = {}


def param_swapper_for(nvme_path: str | os.PathLike, *, rank: int, aio: AioParams) -> ParamSwapper:
    """This process's ParamSwapper for ``nvme_path``: created by zero.Init or by the engine, whichever comes first,
    so parameters swapped out while the model was built are found by the engine that trains it."""
    key = os.fspath(nvme_path)
    swapper = _SWAPPERS.get(key)
    if swapper is None or swapper.dir.closed:
        swapper = _SWAPPERS[key] = ParamSwapper(nvme_path, rank=rank, aio=aio)
    return swapper
