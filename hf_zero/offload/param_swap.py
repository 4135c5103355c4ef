"""``offload_param: {device: nvme}``: ZeRO-3 partitions kept in per-rank swap files instead of memory.

A swapped :class:`~hf_zero.zero.stage3.ShardedParam` keeps an empty ``local_shard`` (its dtype is still the
shard's dtype) and ``sp.swapper`` set to the :class:`ParamSwapper` that holds its values, one stream per
parameter (``p<ds_id>``, ``chunk_numel`` elements)::

    built (zero.Init) -> swap_out: the shard is written to p<id>, the resident copy dropped
    gather            -> read p<id> straight into the all-gather's send buffer (or take a finished read-ahead)
    optimizer step    -> the updated 16-bit values of each tile are written back to p<id>
    cast (bf16 run)   -> p<id> is rewritten in the compute dtype; the fp32 values it was built with move to
                         p<id>.init, read once to build the fp32 master weights, deleted after the first step

Why one stream per parameter rather than one file per optimizer group: parameters are swapped out while the model
is being built, before any group exists, and a parameter is the unit every reader asks for (a module's gather).

Read-ahead: the stage-3 runtime knows which modules come next (its recorded trace) and asks for their partitions
early with :meth:`ParamSwapper.read_ahead`; a gather then only copies from the finished buffer. Read-aheads are
dropped before the optimizer writes new values (:meth:`ParamSwapper.discard_read_ahead`), so none is ever stale.
Memory stays bounded: resident are only the read-ahead buffers (the runtime bounds them by
``stage3_prefetch_bucket_size``) and the gathered modules themselves.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Iterable

import torch

from hf_zero.offload.swapper import AioParams, SwapDir, wait_all
from hf_zero.profiling.timers import NO_TIMERS

if TYPE_CHECKING:
    from hf_zero.zero.stage3.param import ShardedParam

__all__ = ["ParamSwapper", "param_swapper_for"]

CONFIG_KEY = "zero_optimization.offload_param"


class _Done(Future):
    """A finished Future: a read served from a read-ahead buffer needs no waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.set_result(None)


class ParamSwapper:
    """This rank's swapped ZeRO-3 partitions under ``nvme_path``; see the module docstring."""

    def __init__(self, nvme_path: str | os.PathLike, *, rank: int, aio: AioParams) -> None:
        self.nvme_path = os.fspath(nvme_path)
        self.dir = SwapDir(nvme_path, kind="params", rank=rank, sizes_nbytes={}, aio=aio, config_key=CONFIG_KEY)
        self.timers = NO_TIMERS  # the engine's: waiting for a partition's read counts as "offload_io"
        self._ahead: dict[int, tuple[torch.Tensor, Future]] = {}  # ds_id -> (buffer, read in flight)
        self._initial: set[int] = set()  # ds_ids with a p<id>.init stream (fp32 values before the cast)
        self.read_numel = 0  # statistics: elements read from and written to the drive
        self.written_numel = 0
        self.ahead_hits = 0  # reads served from a finished (or in-flight) read-ahead

    # ------------------------------------------------------------------ placement
    def swap_out(self, sp: "ShardedParam") -> None:
        """Move ``sp``'s resident shard (and its fp32 original, if it was cast) into swap streams."""
        if sp.swapper is not None:
            raise ValueError(f"{sp.name} is swapped out already")
        if sp.local_shard.device.type != "cpu":
            raise ValueError(f"{sp.name}: offload_param swaps CPU partitions; this one is on "
                             f"{sp.local_shard.device}")
        name = _stream(sp)
        self.dir.add(name, sp.chunk_numel * sp.local_shard.element_size())
        futures = [self.dir.write_async(name, sp.local_shard.contiguous(), 0)]
        if sp._fp32_shard is not None:
            self.dir.add(name + ".init", sp.chunk_numel * 4)
            futures.append(self.dir.write_async(name + ".init", sp._fp32_shard.contiguous(), 0))
            self._initial.add(sp.ds_id)
        wait_all(futures)
        self.written_numel += sp.chunk_numel
        sp._fp32_shard = None
        sp.swapper = self
        sp.local_shard = torch.empty(0, dtype=sp.local_shard.dtype)
        sp._publish_compat()

    def swap_in(self, sp: "ShardedParam") -> None:
        """The opposite of :meth:`swap_out` (persistent parameters stay resident)."""
        self._own(sp)
        values = self._read_new(sp)
        if sp.ds_id in self._initial:
            sp._fp32_shard = self.read_initial_tensor(sp)
            self.drop_initial(sp)
        self.dir.remove(_stream(sp))
        sp.swapper = None
        sp.local_shard = values
        sp._publish_compat()

    def cast(self, sp: "ShardedParam", dtype: torch.dtype) -> None:
        """Rewrite ``sp``'s stream in ``dtype``; the first cast keeps the fp32 values as the ``.init`` stream."""
        self._own(sp)
        if sp.dtype == dtype:
            return
        self._drop_ahead(sp)
        name = _stream(sp)
        values = self._read_new(sp)
        if sp.ds_id not in self._initial:
            self.dir.add(name + ".init", sp.chunk_numel * 4)
            wait_all([self.dir.write_async(name + ".init", values.float().contiguous(), 0)])
            self._initial.add(sp.ds_id)
        self.dir.remove(name)
        self.dir.add(name, sp.chunk_numel * torch.empty(0, dtype=dtype).element_size())
        wait_all([self.dir.write_async(name, values.to(dtype).contiguous(), 0)])
        sp.local_shard = torch.empty(0, dtype=dtype)
        sp._publish_compat()

    # ------------------------------------------------------------------ values
    def read_async(self, sp: "ShardedParam", out: torch.Tensor, lo: int = 0) -> Future:
        """Fill ``out`` with elements ``[lo, lo + out.numel())`` of ``sp``'s shard."""
        self._own(sp)
        ahead = self._ahead.pop(sp.ds_id, None)
        if ahead is not None:
            buf, fut = ahead
            self.ahead_hits += 1
            with self.timers.phase("offload_io"):
                fut.result()
            out.copy_(buf[lo:lo + out.numel()])
            return _Done()
        self.read_numel += out.numel()
        return self.dir.read_async(_stream(sp), out, lo)

    def read(self, sp: "ShardedParam", out: torch.Tensor, lo: int = 0) -> None:
        with self.timers.phase("offload_io"):
            self.read_async(sp, out, lo).result()

    def write_async(self, sp: "ShardedParam", values: torch.Tensor, lo: int = 0) -> Future:
        """Store ``values`` as elements ``[lo, lo + values.numel())`` of ``sp``'s shard (cast to its dtype)."""
        self._own(sp)
        self._drop_ahead(sp)
        self.written_numel += values.numel()
        return self.dir.write_async(_stream(sp), values.to(sp.dtype).contiguous(), lo)

    def read_initial(self, sp: "ShardedParam", out: torch.Tensor, lo: int = 0) -> None:
        """Elements ``[lo, lo + out.numel())`` of the fp32 values ``sp`` was built with (``out`` fp32)."""
        self._own(sp)
        if sp.ds_id in self._initial:
            with self.timers.phase("offload_io"):
                self.dir.read_async(_stream(sp) + ".init", out, lo).result()
        elif sp.dtype == torch.float32:
            self.read(sp, out, lo)
        else:
            tmp = torch.empty(out.numel(), dtype=sp.dtype)
            self.read(sp, tmp, lo)
            out.copy_(tmp)

    def read_initial_tensor(self, sp: "ShardedParam") -> torch.Tensor:
        out = torch.empty(sp.chunk_numel, dtype=torch.float32)
        self.read_initial(sp, out)
        return out

    def drop_initial(self, sp: "ShardedParam") -> None:
        if sp.ds_id in self._initial:
            self._initial.discard(sp.ds_id)
            self.dir.remove(_stream(sp) + ".init")

    # ------------------------------------------------------------------ read-ahead
    def read_ahead(self, sps: Iterable["ShardedParam"]) -> int:
        """Start reading the shards of ``sps`` into buffers of their own; returns the elements newly requested."""
        numel = 0
        for sp in sps:
            if sp.swapper is self and sp.ds_id not in self._ahead:
                buf = torch.empty(sp.chunk_numel, dtype=sp.dtype)
                self._ahead[sp.ds_id] = (buf, self.dir.read_async(_stream(sp), buf, 0))
                numel += sp.chunk_numel
                self.read_numel += sp.chunk_numel
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
    def _own(self, sp: "ShardedParam") -> None:
        if sp.swapper is not self:
            raise ValueError(f"{sp.name} is not swapped out by this ParamSwapper ({self.dir.path})")

    def _drop_ahead(self, sp: "ShardedParam") -> None:
        ahead = self._ahead.pop(sp.ds_id, None)
        if ahead is not None:
            ahead[1].result()

    def _read_new(self, sp: "ShardedParam") -> torch.Tensor:
        out = torch.empty(sp.chunk_numel, dtype=sp.dtype)
        self.read(sp, out)
        return out


def _stream(sp: "ShardedParam") -> str:
    return f"p{sp.ds_id}"


_SWAPPERS: dict[str, ParamSwapper] = {}


def param_swapper_for(nvme_path: str | os.PathLike, *, rank: int, aio: AioParams) -> ParamSwapper:
    """This process's ParamSwapper for ``nvme_path``: created by zero.Init or by the engine, whichever comes first,
    so parameters swapped out while the model was built are found by the engine that trains it."""
    key = os.fspath(nvme_path)
    swapper = _SWAPPERS.get(key)
    if swapper is None or swapper.dir.closed:
        swapper = _SWAPPERS[key] = ParamSwapper(nvme_path, rank=rank, aio=aio)
    return swapper
