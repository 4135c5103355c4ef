"""Wiring ZeRO-3's partitioned parameters into the engine's optimizer groups.

A :class:`Stage3Group` offers the optimizer what a stage 1/2 :class:`~hf_zero.zero.sharded_group.ShardedGroup`
does (fp32 master shard, gradient shard, 16-bit shard in the same :class:`~hf_zero.zero.layout.ShardLayout`, and
the same methods), without being one: its 16-bit shard and gradient shard are not copies. Each
:class:`~hf_zero.zero.stage3.ShardedParam` is re-pointed at its slice of the group's flat buffers, so the fused
Adam pass writes the model's shards directly and the stage-3 gradient reduce-scatter adds straight into the
optimizer's gradient shard. There is nothing to publish after a step beyond the runtime's own ``after_step``
(persistent parameters).
"""

from __future__ import annotations

import bisect
import logging
from concurrent.futures import Future

import torch

from hf_zero import comm
from hf_zero.comm.device import accelerator_type
from hf_zero.comm.host_memory import zero_and_release
from hf_zero.config.policies import NVMeOffloadPolicy, ZeroPolicy
from hf_zero.zero.layout import ShardLayout

logger = logging.getLogger("hf_zero")

__all__ = ["Stage3Group", "build_stage3_groups"]


class Stage3Group:
    """The optimizer's view of already-partitioned parameters; see the module docstring.

    With ``offload_param: nvme`` some shards are in swap files, so there is no flat 16-bit buffer: ``param16`` is
    None and :meth:`write_param16` sends each updated range to the parameters' own storage (file or tensor).
    ``master_offloaded``: the optimizer offload will own the fp32 master, so it is not built here (``master`` is
    a meta tensor: its shape and dtype, no bytes); the offload reads the starting values range by range with
    :meth:`initial_master`.
    """

    def __init__(self, sps, *, world_size: int, rank: int, compute_dtype: torch.dtype, grad_dtype: torch.dtype,
                 master_offloaded: bool = False, master_dtype: torch.dtype = torch.float32, pin_memory: bool = False):
        self.sps = list(sps)
        self.params = [sp.param for sp in self.sps]
        self.names = [sp.name for sp in self.sps]
        self.world_size = world_size
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.persistent_grad = True  # stage 3 reduces every micro-step, like stage 2
        self._grad_dtype = grad_dtype
        self.layout = ShardLayout(tuple(sp.numel for sp in self.sps), world_size)
        numel = self.layout.shard_numel
        # the shards' home: the GPU, or host memory with offload_param (then the optimizer steps there too, and
        # with offload_param.pin_memory the flat buffers are page-locked: the gathers copy from them and the
        # gradients to them, every step)
        device = self.sps[0].storage.device if self.sps else torch.device("cpu")
        pin = pin_memory and device.type == "cpu" and accelerator_type() == "cuda"
        swapped = any(sp.swapped for sp in self.sps)
        self.grad = _zeros(numel, grad_dtype, device, pin)
        if swapped:
            self.master = torch.empty(numel, dtype=master_dtype, device="meta" if master_offloaded else device)
            self.param16 = None
            if not master_offloaded:
                self.initial_master(0, numel, self.master)
        else:
            self.master = _zeros(numel, master_dtype, device, pin)
            self.initial_master(0, numel, self.master)
            self.param16 = (self.master if compute_dtype == master_dtype else
                            _zeros(numel, compute_dtype, device, pin).copy_(self.master))
        for i, sp in enumerate(self.sps):
            lo, hi = self.layout.offsets[i], self.layout.offsets[i + 1]
            assert hi - lo == sp.shard_numel, (sp.name, hi - lo, sp.shard_numel)
            if self.param16 is not None:
                sp.use_shard_storage(self.param16[lo:hi])
            sp.use_grad_storage(self.grad[lo:hi])
        self.grad_fresh = True  # torch.zeros above

    def release_master(self) -> None:
        """See :meth:`ShardedGroup.release_master <hf_zero.zero.sharded_group.ShardedGroup.release_master>`."""
        self.master = torch.empty(self.master.shape, dtype=self.master.dtype, device="meta")

    def _pieces(self, lo: int, hi: int):
        """``(sp, start, stop, offset)`` for each parameter shard overlapping the shard range ``[lo, hi)``:
        elements ``[start, stop)`` of sp's shard are ``[offset, offset + stop - start)`` of the range."""
        offsets = self.layout.offsets
        i = max(bisect.bisect_right(offsets, lo) - 1, 0)
        while i < len(self.sps) and offsets[i] < hi:
            a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
            if a < b:
                yield self.sps[i], a - offsets[i], b - offsets[i], a - lo
            i += 1

    def initial_master(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out`` <- elements ``[lo, hi)`` of the fp32 starting values; a bf16 ``out`` (bf16 master weights) gets
        them rounded once (the shards' stores read fp32 bytes, so they read into an fp32 buffer first)."""
        target = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        for sp, a, b, off in self._pieces(lo, hi):
            sp.read_initial_fp32(target[off:off + b - a], a)
        if target is not out:
            out.copy_(target)

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    def write_param16(self, lo: int, hi: int, values: torch.Tensor) -> list[Future]:
        """Make elements ``[lo, hi)`` of the 16-bit shard equal ``values``: the flat buffer the parameters' storages
        are views of, or (swapped shards) each parameter's own storage. Returns the writes still in flight."""
        if self.param16 is not None:
            dst = self.param16[lo:hi]
            if dst.data_ptr() != values.data_ptr():  # fp32 training: the master slice *is* the weights
                dst.copy_(values)
            return []
        futures = []
        for sp, a, b, off in self._pieces(lo, hi):
            futures.append(sp.storage.write_async(values[off:off + b - a], a))
        return futures

    def ensure_grad(self) -> None:
        """The gradient shard always exists: the ShardedParams' grad storages are views of it."""

    def clear_grad(self) -> None:
        # zeros whose pages go back to the kernel: resident again only as the next backward's reductions reach them
        zero_and_release(self.grad)
        self.grad_fresh = True

    @property
    def grad_fresh(self) -> bool:
        """Whether the gradient shard holds the zeros of :meth:`clear_grad` (see ShardedParam.grad_zeroed). Whoever
        writes ``grad`` other than the reducer sets it False (tensor_fragment's safe_set_*_grad)."""
        return self._grad_fresh

    @grad_fresh.setter
    def grad_fresh(self, fresh: bool) -> None:
        self._grad_fresh = bool(fresh)
        for sp in self.sps:
            sp.grad_zeroed = self._grad_fresh


def _zeros(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device, pin_memory=pin)


def _leaves_by_granularity(module, threshold: int) -> None:
    from hf_zero.zero.leaf import module_granularity, set_z3_leaf_modules_by_granularity

    granularity = module_granularity(module)
    chosen = set_z3_leaf_modules_by_granularity(module, threshold, granularity)
    if chosen:
        names = {m: n or "<root>" for n, m in module.named_modules()}
        classes = sorted({type(m).__name__ for m in chosen})
        logger.info("hf_zero ZeRO-3: stage3_module_granularity_threshold %d gathers %d modules as one unit each "
                    "(classes %s; first %s)", threshold, len(chosen), classes, names[chosen[0]])
        return
    smallest = min(((g, type(m).__name__) for m, g in granularity.items() if g is not None),
                   default=None)
    hint = (f"the smallest module granularity is {smallest[0]} ({smallest[1]}): set it to at least that"
            if smallest else "the model has no module with sub-modules that own parameters")
    logger.warning("hf_zero ZeRO-3: zero_optimization.stage3_module_granularity_threshold %d selects no module, so "
                   "parameters are still fetched module by module; %s", threshold, hint)


def build_stage3_groups(module, plan, zero: ZeroPolicy, compute_dtype: torch.dtype, grad_dtype: torch.dtype,
                        process_group=None, master_dtype: torch.dtype = torch.float32):
    """Partition ``module`` (if zero.Init did not already) and build one Stage3Group per optimizer group."""
    from hf_zero.offload.param_swap import param_swapper_for
    from hf_zero.zero.leaf import apply_leaf_module_config
    from hf_zero.zero.stage3 import Stage3Runtime

    world, rank = comm.get_world_size(process_group), comm.get_rank(process_group)
    swapper = None
    if isinstance(zero.offload_param, NVMeOffloadPolicy):
        swapper = param_swapper_for(zero.offload_param.nvme_path, rank=rank, aio=zero.offload_param.aio)
    s3 = zero.stage3
    leaves = s3.leaf_modules
    apply_leaf_module_config(module, leaves.classes, leaves.names, leaves.name_suffixes,
                             warn_unmatched=leaves.warn_unmatched)
    if s3.module_granularity_threshold > 0:
        _leaves_by_granularity(module, s3.module_granularity_threshold)
    runtime = Stage3Runtime(
        module, group=process_group, compute_dtype=compute_dtype,
        reduce_bucket_size=zero.reduce_bucket_numel, prefetch_bucket_size=s3.prefetch_bucket_numel,
        max_live_parameters=s3.max_live_numel, max_reuse_distance=s3.max_reuse_distance,
        param_persistence_threshold=s3.persistence_threshold,
        model_persistence_threshold=s3.model_persistence_threshold, overlap_comm=zero.overlap_comm,
        grad_scale=1.0 / world, divergence_timeout_s=s3.divergence_timeout_s, swapper=swapper,
        keep_whole_alone=True, log_trace_misses=s3.log_trace_misses)
    sp_of = {id(sp.param): sp for sp in runtime.sharded_params()}
    groups, seen = [], set()
    for params, _ in (plan.groups if plan is not None else ()):  # no plan: an evaluation engine, no groups
        sps = []
        for p in params:
            sp = sp_of.get(id(p))
            if sp is None:
                raise ValueError("hf_zero ZeRO-3: an optimizer parameter is not a parameter of the model "
                                 "(pass model.parameters() or groups built from them)")
            if sp.requires_grad and id(p) not in seen:
                seen.add(id(p))
                sps.append(sp)
        groups.append(Stage3Group(sps, world_size=world, rank=rank, compute_dtype=compute_dtype,
                                  grad_dtype=grad_dtype, master_offloaded=zero.offload_optimizer is not None,
                                  master_dtype=master_dtype,
                                  pin_memory=zero.offload_param is not None and zero.offload_param.pin_memory))
    return runtime, groups
