"""Optimizer-state offload: where the fp32 master weights and Adam moments of each group's shard live.

``zero_optimization.offload_optimizer`` moves, for every :class:`~hf_zero.zero.sharded_group.ShardedGroup`, the
three streams ``master``, ``exp_avg`` and ``exp_avg_sq`` (fp32: 12 bytes per parameter of the shard; with
``bf16.bf16_master_weights_and_grads`` a bf16 master, 10 bytes, and with ``bf16_optimizer_states`` bf16 moments, 6)
out of the accelerator's memory; the 16-bit weights (``param16``) and the gradient shard stay where they were.

Each group's shard ``[0, shard_numel)`` is split in two tiers::

    [0, keep)             resident on the compute device; stepped in place      keep = shard_numel - offloaded
    [keep, shard_numel)   offloaded: CPU memory (device "cpu") or per-rank swap files (device "nvme")
                          offloaded = round(ratio * shard_numel)                (offload_optimizer.ratio, default 1)

and the offloaded tier is stepped tile by tile, tiles of at most ``sub_group_size`` elements. Per tile: the
gradient slice is brought to the CPU (a no-op when it is there already), the compiled CPU Adam updates master and
moments and writes the 16-bit weights in the same pass, and those are copied back into ``param16``. With NVMe, two
sets of tile buffers alternate: tile i+1 is read, and tile i-1 written, while tile i is computed, so at most
``2 * 3 * sub_group_size * 4`` bytes of offloaded state are resident at any time.

Each group releases its own master (``release_master``: it stays a meta tensor of the master's shape and dtype,
the key of ``optimizer.state`` and the entry of ``param_groups``, holding no bytes);
:meth:`OptimizerOffload.state_tensors` and :meth:`~OptimizerOffload.load_state_tensors` give checkpoints the full
per-group tensors, so a checkpoint holds the same optimizer state with or without offload. For fp32 training
``param16`` *was* ``master``: it keeps that storage as the model's weights and the master copy moves out.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

import torch

from hf_zero.config.policies import AioParams, NVMeOffloadPolicy, ZeroPolicy
from hf_zero.offload.params import check_optimizer_offload
from hf_zero.offload.swapper import SwapDir, wait_all
from hf_zero.offload.transfers import HostStaging
from hf_zero.ops.adam import AdamHyper, adam_step_, adam_step_any_dtype_, adam_step_reference
from hf_zero.profiling.timers import NO_TIMERS

__all__ = ["OptimizerOffload", "STATE_NAMES", "build_optimizer_offload"]

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
_pin_warned = False


def _host_empty(numel: int, pin: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeroed CPU buffer, page-locked when asked and possible; pageable with one warning otherwise."""
    return _pinned_or_pageable(torch.zeros(numel, dtype=dtype), pin)


def _host_copy(src: torch.Tensor, pin: bool) -> torch.Tensor:
    """``src`` in CPU memory: src itself when it is on the CPU already and need not be pinned (no copy)."""
    if src.device.type == "cpu" and not (pin and torch.cuda.is_available()):
        _pinned_or_pageable(src, pin)  # the pin_memory warning, if asked for
        return src
    return _pinned_or_pageable(src.detach().to("cpu", copy=True), pin)


def _pinned_or_pageable(t: torch.Tensor, pin: bool) -> torch.Tensor:
    global _pin_warned
    if not pin:
        return t
    if torch.cuda.is_available():
        try:
            return t.pin_memory()
        except RuntimeError as exc:
            reason = f"pinning failed ({exc})"
    else:
        reason = "there is no CUDA device to pin host memory for"
    if not _pin_warned:
        _pin_warned = True
        warnings.warn(f"hf_zero: offload_optimizer.pin_memory=true but {reason}; using pageable memory",
                      RuntimeWarning, stacklevel=3)
    return t


@dataclass(frozen=True)
class _Tile:
    group: int
    lo: int  # element range [lo, hi) of the group's shard, inside the offloaded tier
    hi: int


class OptimizerOffload:
    """Owns master weights and Adam moments of every group when optimizer offload is on; see the module docstring.
    The optimizer back-end of those runs (hf_zero.zero.optimizer_backend): one ``step`` for every placement."""

    uses_adam_hyper = True
    offloaded = True

    def __init__(self, groups: Sequence, *, device: str, nvme_path: str | None, pin_memory: bool, ratio: float,
                 sub_group_size: int, aio: AioParams, rank: int, torch_adam: bool = False,
                 state_dtype: torch.dtype = torch.float32):
        """``state_dtype``: the Adam moments' (bf16 with ``bf16.bf16_optimizer_states``). The masters keep the
        groups' own dtype: bf16 with ``bf16.bf16_master_weights_and_grads`` (then, as for fp32 training, the master
        is the weights), which the CPU Adam updates in fp32 and rounds once -- DeepSpeed's ZeRO-Offload with bf16
        master weights."""
        if device not in ("cpu", "nvme"):
            raise ValueError(f"offload_optimizer.device={device!r}: expected 'cpu' or 'nvme'")
        self.groups = list(groups)
        self.device = device
        self.dtypes = {"master": self.groups[0].master.dtype if self.groups else torch.float32,
                       "exp_avg": state_dtype, "exp_avg_sq": state_dtype}
        # the update: the compiled CPU Adam, or with optimizer.params.torch_adam torch's own AdamW arithmetic (torch
        # ops, adam_step_reference) on the same offloaded tiles -- DeepSpeed runs torch.optim.Adam(W) there
        self._update = adam_step_reference if torch_adam else adam_step_
        self.timers = NO_TIMERS  # the engine's: time blocked on NVMe reads/writes counts as "offload_io"
        self.ratio = float(ratio)
        self.tile_numel = max(1, int(sub_group_size))
        self.keep = [g.shard_numel - int(round(self.ratio * g.shard_numel)) for g in self.groups]
        # resident tier: three (keep,) fp32 tensors per group on the compute device
        self._resident: list[dict[str, torch.Tensor]] = []
        # offloaded tier, device "cpu": three (shard_numel - keep,) fp32 host tensors per group
        self._host: list[dict[str, torch.Tensor]] = []
        self.swap: SwapDir | None = None
        self.tiles = [_Tile(gi, lo, min(lo + self.tile_numel, g.shard_numel))
                      for gi, g in enumerate(self.groups)
                      for lo in range(self.keep[gi], g.shard_numel, self.tile_numel)]
        if device == "nvme":
            sizes = {f"group{gi}.{s}": (g.shard_numel - self.keep[gi]) * self.dtypes[s].itemsize
                     for gi, g in enumerate(self.groups) for s in STATE_NAMES}
            self.swap = SwapDir(nvme_path, kind="optimizer", rank=rank, sizes_nbytes=sizes, aio=aio,
                                config_key="zero_optimization.offload_optimizer")
        for gi, g in enumerate(self.groups):
            k, n = self.keep[gi], g.shard_numel
            master = g.master
            # A group may hand over no master at all (ZeRO-3 with swapped shards builds none, a meta tensor):
            # the starting values are then read range by range with g.initial_master, never materialised whole.
            built = not master.is_meta
            on = g.grad.device  # the group's device (its master may hold no bytes)
            # Views where the master may stay where it is (no copy); a clone where a view would keep the whole
            # fp32 buffer alive after its offloaded part went to NVMe (16-bit training).
            keep_view = built and (g.param16 is master or (device == "cpu" and master.device.type == "cpu"))
            if keep_view:
                resident_master = master[:k]
            else:
                resident_master = torch.empty(k, dtype=self.dtypes["master"], device=on)
                g.initial_master(0, k, resident_master)
            self._resident.append({"master": resident_master,
                                   **{s: torch.zeros_like(resident_master, dtype=self.dtypes[s])
                                      for s in ("exp_avg", "exp_avg_sq")}})
            if device == "cpu":
                # CPU training: the master is in CPU memory already and stays (for fp32 it is the weights)
                host = {s: _host_empty(n - k, pin_memory, self.dtypes[s]) for s in ("exp_avg", "exp_avg_sq")}
                if built:
                    host["master"] = _host_copy(master[k:], pin_memory)
                else:
                    host["master"] = _host_empty(n - k, pin_memory, self.dtypes["master"])
                    g.initial_master(k, n, host["master"])
                self._host.append(host)
            else:
                buf = torch.empty(min(self.tile_numel, n - k), dtype=self.dtypes["master"])
                for lo in range(k, n, self.tile_numel):
                    hi = min(lo + self.tile_numel, n)
                    g.initial_master(lo, hi, buf[:hi - lo])
                    self.swap.write_async(f"group{gi}.master", buf[:hi - lo], lo - k).result()
            # The master moves out. fp32 training: param16 is the same tensor and stays as the model's weights.
            g.release_master()
        # NVMe: two sets of tile buffers, used alternately (compute on one while the other is read / written)
        max_tile = max((t.hi - t.lo for t in self.tiles), default=0)
        self._tile_bufs = ([{s: _host_empty(max_tile, pin_memory, self.dtypes[s]) for s in STATE_NAMES}
                            for _ in range(2)] if device == "nvme" else [])
        # CPU offload of a GPU run: gradients down and 16-bit weights up on side streams, overlapping the CPU Adam
        # (transfers.py); a CPU run's gradients are on the host already
        master16 = self.dtypes["master"] != torch.float32
        self._staging = (HostStaging(self.groups, self.keep, pin_memory, master16=master16)
                         if device == "cpu" and self.tiles and HostStaging.wanted(self.groups) else None)

    # ---- the step ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, states, hyper: Sequence[AdamHyper], divisor: float) -> None:
        """One Adam step of every group; ``hyper[gi]``: group gi's hyper-parameters for this step. ``states``
        (the optimizer's, holding the step counts) is not needed: the moments are here."""
        for gi, g in enumerate(self.groups):
            k = self.keep[gi]
            if k:
                r = self._resident[gi]
                wait_all(self._adam(g, hyper[gi], divisor, 0, k, r["master"], r["exp_avg"], r["exp_avg_sq"]))
        if self._staging is not None:
            self._staged_step(hyper, divisor)
            return
        if self.device == "cpu":
            writes = []  # 16-bit weights on their way to swapped ZeRO-3 shards (offload_param nvme)
            for t in self.tiles:
                g, h, base = self.groups[t.group], self._host[t.group], self.keep[t.group]
                sl = slice(t.lo - base, t.hi - base)
                writes += self._adam(g, hyper[t.group], divisor, t.lo, t.hi, h["master"][sl], h["exp_avg"][sl],
                                     h["exp_avg_sq"][sl])
            with self.timers.phase("offload_io"):
                wait_all(writes)
            return
        self._nvme_step(hyper, divisor)

    def _staged_step(self, hyper: Sequence[AdamHyper], divisor: float) -> None:
        """The CPU tier of a GPU run, copies overlapped with the CPU Adam (see transfers.py)."""
        st = self._staging
        events = st.download(self.tiles)
        writes = []
        for t, ready in zip(self.tiles, events):
            g, h, base = self.groups[t.group], self._host[t.group], self.keep[t.group]
            sl = slice(t.lo - base, t.hi - base)
            with self.timers.phase("offload_io"):
                ready.synchronize()
            out16 = st.out16(t)
            adam_step_any_dtype_(h["master"][sl], st.grad(t), h["exp_avg"][sl], h["exp_avg_sq"][sl],
                                 update=self._update, **hyper[t.group].kwargs(), grad_scale=divisor, out16=out16)
            if out16 is not None:
                st.upload(t)
            else:  # fp32 weights (or a swapped ZeRO-3 shard): written from the master as before
                writes += g.write_param16(t.lo, t.hi, h["master"][sl])
        st.finish()
        with self.timers.phase("offload_io"):
            wait_all(writes)

    def _nvme_step(self, hyper: Sequence[AdamHyper], divisor: float) -> None:
        tiles = self.tiles
        if not tiles:
            return
        writes: list[list[Future]] = [[], []]
        reads = self._read_tile(tiles[0], self._tile_bufs[0])
        for i, t in enumerate(tiles):
            cur = self._tile_bufs[i % 2]
            with self.timers.phase("offload_io"):
                wait_all(reads)
            if i + 1 < len(tiles):
                with self.timers.phase("offload_io"):
                    wait_all(writes[(i + 1) % 2])  # the other buffer set is free once tile i-1 is on disk
                reads = self._read_tile(tiles[i + 1], self._tile_bufs[(i + 1) % 2])
            numel = t.hi - t.lo
            params16 = self._adam(self.groups[t.group], hyper[t.group], divisor, t.lo, t.hi,
                                  cur["master"][:numel], cur["exp_avg"][:numel], cur["exp_avg_sq"][:numel])
            writes[i % 2] = self._write_tile(t, cur) + params16
        with self.timers.phase("offload_io"):
            wait_all(writes[0] + writes[1])

    def _read_tile(self, t: _Tile, bufs: dict[str, torch.Tensor]) -> list[Future]:
        off, numel = t.lo - self.keep[t.group], t.hi - t.lo
        return [self.swap.read_async(f"group{t.group}.{s}", bufs[s][:numel], off) for s in STATE_NAMES]

    def _write_tile(self, t: _Tile, bufs: dict[str, torch.Tensor]) -> list[Future]:
        off, numel = t.lo - self.keep[t.group], t.hi - t.lo
        return [self.swap.write_async(f"group{t.group}.{s}", bufs[s][:numel], off) for s in STATE_NAMES]

    def _adam(self, g, h: AdamHyper, divisor: float, lo: int, hi: int, master: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor) -> list[Future]:
        """Adam on elements [lo, hi) of group g, whose states are ``master``/``exp_avg``/``exp_avg_sq`` (hi-lo,).
        Returns the writes of the 16-bit weights still in flight (swapped ZeRO-3 shards); ``master`` must not
        be reused before they finish."""
        grad = g.grad[lo:hi]
        if grad.device != master.device:
            grad = grad.to(master.device)
        param16 = g.param16[lo:hi] if g.param16 is not None else None
        # an fp32 master writes the 16-bit weights in its own pass; a 16-bit master is the weights' values already
        direct16 = param16 is not None and param16.dtype != master.dtype and param16.device == master.device
        adam_step_any_dtype_(master, grad, exp_avg, exp_avg_sq, update=self._update, **h.kwargs(), grad_scale=divisor,
                             out16=param16 if direct16 else None)
        if direct16:
            return []
        return g.write_param16(lo, hi, master)  # a no-op when the master is the weights' own memory

    # ---- checkpoint access ------------------------------------------------------------------------------------------
    def state_tensors(self, gi: int) -> dict[str, torch.Tensor]:
        """Full ``(shard_numel,)`` copies of group gi's master, exp_avg and exp_avg_sq (read from NVMe), each in its
        own dtype (``self.dtypes``)."""
        g, k = self.groups[gi], self.keep[gi]
        out = {}
        for s in STATE_NAMES:
            full = torch.empty(g.shard_numel, dtype=self.dtypes[s])
            full[:k].copy_(self._resident[gi][s])
            if self.device == "cpu":
                full[k:].copy_(self._host[gi][s])
            elif g.shard_numel > k:
                self.swap.read_async(f"group{gi}.{s}", full[k:], 0).result()
            out[s] = full
        return out

    def load_state_tensors(self, gi: int, tensors: dict[str, torch.Tensor]) -> None:
        """Replace group gi's states with ``tensors`` (names from STATE_NAMES, ``(shard_numel,)`` each) and refresh
        the 16-bit weights from the master."""
        g, k = self.groups[gi], self.keep[gi]
        for s, full in tensors.items():
            full = full.detach().to(self.dtypes[s]).cpu().contiguous()
            self._resident[gi][s].copy_(full[:k])
            if self.device == "cpu":
                self._host[gi][s].copy_(full[k:])
            elif g.shard_numel > k:
                self.swap.write_async(f"group{gi}.{s}", full[k:], 0).result()
            if s == "master":
                wait_all(g.write_param16(0, g.shard_numel, full))

    # ---- accounting -------------------------------------------------------------------------------------------------
    def offloaded_numel(self) -> int:
        return sum(g.shard_numel - k for g, k in zip(self.groups, self.keep))

    def resident_state_nbytes(self) -> int:
        """Bytes of optimizer state held in memory: the resident tier, host tensors, and NVMe tile buffers."""
        tensors = [t for r in self._resident for t in r.values()] + [t for h in self._host for t in h.values()]
        tensors += [t for b in self._tile_bufs for t in b.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def staging_nbytes(self) -> int:
        """Page-locked host bytes for the GPU transfers (gradient and 16-bit weight copies); 0 on a CPU run."""
        return self._staging.host_nbytes() if self._staging is not None else 0

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()
        if self.swap is not None:
            self.swap.close()


def build_optimizer_offload(groups: Sequence, zero: ZeroPolicy, *, rank: int, fused_adam: bool,
                            torch_adam: bool = False, state_dtype: torch.dtype = torch.float32
                            ) -> OptimizerOffload | None:
    """The offload object for ``zero_optimization.offload_optimizer``, or None when it is off."""
    off = zero.offload_optimizer
    if off is None:
        return None
    check_optimizer_offload(zero, fused_adam=fused_adam, torch_adam=torch_adam)
    nvme = off if isinstance(off, NVMeOffloadPolicy) else None
    return OptimizerOffload(groups, device=off.device, nvme_path=nvme.nvme_path if nvme else None,
                            pin_memory=off.pin_memory, ratio=zero.offload_ratio, sub_group_size=zero.sub_group_size,
                            aio=nvme.aio if nvme else AioParams(), rank=rank, torch_adam=torch_adam,
                            state_dtype=state_dtype)
