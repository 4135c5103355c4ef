"""This rank's share of one optimizer parameter group: fp32 master shard, gradient shard, 16-bit shard.

For ZeRO stages 1 and 2 every trainable parameter of the group is cut by :class:`~hf_zero.zero.layout.ShardLayout`
over the data-parallel world; stage 0 uses the same object with a world of one (every rank holds everything),
so the optimizer and checkpoint code never branch on the stage.

Buffers, each ``(shard_numel,)`` flat and in the layout's order::

    master   fp32            the weights the optimizer updates (also the source of the published 16-bit weights)
    grad     grad_dtype      reduced gradients of this rank's shards. Allocated when the first reducing backward
                             of an accumulation window begins (every micro-step at stage 2, the boundary at
                             stages 0/1: between micro-steps ``param.grad`` holds them) and freed after the step,
                             so the forward pass never carries it. ``grad_fresh``: nothing was reduced into it yet,
                             so the first reduction of a bucket may write its result in place instead of adding
    param16  compute dtype   master cast to the model's dtype, written by the optimizer in the same pass;
                             for fp32 training it *is* ``master`` (no copy). Stage 3 with swapped shards
                             has none (None): updated values go out through :meth:`ShardedGroup.write_param16`

Where each tensor lives after a step, per configuration (the one table of it; stage 3's group is
:class:`~hf_zero.zero.stage3_groups.Stage3Group`, the shard storages are :mod:`hf_zero.zero.stage3.storage`)::

    configuration        master (fp32)             param16                  grad                 module .data
    stage 0              own buffer (fp32: is      master cast (fp32: is    flat, at the         views of param16
                         param16)                  master)                  boundary only        (a world of one)
    stages 1, 2          own (shard_numel,)        master cast (fp32: is    shard, from the      full tensors,
                                                   master)                  window's first       all-gathered from
                                                                            backward to the step param16 (publish)
    stage 3              own (shard_numel,)        flat buffer; every       flat shard; every    (0,) placeholder
                                                   param's resident         param's grad_storage until gathered
                                                   storage is a view of it  is a view of it      for its module
    stage 3, swapped     read range by range       None: write_param16      as stage 3           gathered from the
    (offload_param nvme) (never whole if offload)  writes to swap files                          swap files
    + offload_optimizer  meta tensor (shape and    unchanged (written tile  unchanged (copied to unchanged
                         dtype, no bytes): the key by tile)                 the CPU per tile)
                         of optimizer.state; the values live in OptimizerOffload (resident tier, then CPU
                         memory or NVMe files), the optimizer back-end of those runs
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

import torch
from torch import nn

from hf_zero.comm import all_gather_delivered, faults
from hf_zero.comm.expert_groups import ExpertGroups
from hf_zero.zero.layout import ShardLayout, capped_bucket_numel
from hf_zero.zero.local import local_tensor

__all__ = ["ShardedGroup", "bucket_ranges", "comm_group", "holders"]


def bucket_ranges(shard_numels: Sequence[int], world_size: int, bucket_numel: int) -> list[tuple[int, int]]:
    """Consecutive parameter index ranges whose packed size (world_size * shard) stays under ``bucket_numel``.

    A parameter larger than the bucket gets a bucket of its own.
    """
    ranges, start, size = [], 0, 0
    for i, c in enumerate(shard_numels):
        if i > start and size + c * world_size > bucket_numel:
            ranges.append((start, i))
            start, size = i, 0
        size += c * world_size
    if start < len(shard_numels):
        ranges.append((start, len(shard_numels)))
    return ranges


def comm_group(group, default=None):
    """The process group ``group``'s (a ShardedGroup's or a Stage3Group's) shards are reduced and gathered over: its
    EDP group for expert-parallel parameters, else ``default`` (the engine's data-parallel group)."""
    expert = getattr(group, "expert", None)
    return expert.edp_group if expert is not None else default


def holders(group, data_parallel_size: int) -> int:
    """How many ranks hold a copy of ``group``'s shard on this rank: a world of one (stage 0) is held by every rank
    of the data-parallel group (``data_parallel_size``), or of the EDP group for experts; a cut group by one."""
    expert = getattr(group, "expert", None)
    ranks = expert.edp_size if expert is not None else data_parallel_size
    return ranks // group.world_size


class ShardedGroup:
    """The shard of one parameter group held by ``rank`` of ``world_size``."""

    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str], *, world_size: int, rank: int,
                 compute_dtype: torch.dtype, grad_dtype: torch.dtype, persistent_grad: bool,
                 master_dtype: torch.dtype = torch.float32, expert: ExpertGroups | None = None):
        """``expert``: a group of expert-parallel MoE parameters, held by this rank's place in those expert groups
        (hf_zero/comm/expert_groups.py); ``world_size`` / ``rank`` are then over its EDP group (1 / 0 at stage 0)."""
        self.params = list(params)
        self.names = list(names)
        self.world_size = world_size
        self.rank = rank
        self.expert = expert
        self.compute_dtype = compute_dtype
        # sizes and storage are this rank's: a tensor-parallel DTensor parameter contributes its local shard
        self.layout = ShardLayout(tuple(local_tensor(p).numel() for p in self.params), world_size)
        numel = self.layout.shard_numel
        device = self.params[0].device if self.params else torch.device("cpu")
        # (shard_numel,) fp32: this rank's shards of every parameter, copied before the model is cast to 16 bit
        # fp32, or bf16 with bf16.bf16_master_weights_and_grads (then it is also the 16-bit shard: one copy)
        self.master = torch.zeros(numel, dtype=master_dtype, device=device)
        for i, p in enumerate(self.params):
            self.layout.shard_of(local_tensor(p).detach().reshape(-1).float(), i, rank, self.master_shard_of(i))
        self.persistent_grad = persistent_grad
        self._grad_dtype = grad_dtype
        self._device = device
        self.grad = torch.zeros(numel if persistent_grad else 0, dtype=grad_dtype, device=device)
        self.grad_fresh = True  # see the module docstring
        self.param16 = self.master if compute_dtype == master_dtype else self.master.to(compute_dtype)
        if world_size == 1:
            self._bind_params()

    def _bind_params(self) -> None:
        """A world of one: the flat 16-bit shard is every parameter, end to end, so make the parameters views of it.

        The optimizer's in-place update then *is* the model update (no publish copy), and fp32 training keeps a
        single copy of the weights instead of parameters plus masters.
        """
        for i, p in enumerate(self.params):
            lo = self.layout.offsets[i]
            local = local_tensor(p)
            local.data = self.param16[lo:lo + local.numel()].view(local.shape)

    def release_master(self) -> None:
        """The optimizer back-end keeps the master elsewhere (offload_optimizer): drop this copy. ``master`` stays a
        meta tensor of its shape and dtype -- what the master is, holding no bytes -- as the key of the optimizer's
        state and param_groups. fp32 training: ``param16`` keeps the storage as the model's weights."""
        self.master = torch.empty(self.master.shape, dtype=self.master.dtype, device="meta")

    def master_shard_of(self, index: int) -> torch.Tensor:
        lo, hi = self.layout.offsets[index], self.layout.offsets[index + 1]
        return self.master[lo:hi]

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    def initial_master(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out`` (fp32) <- elements ``[lo, hi)`` of the master shard as built (what an offload starts from)."""
        out.copy_(self.master[lo:hi])

    def write_param16(self, lo: int, hi: int, values: torch.Tensor) -> list[Future]:
        """Make elements ``[lo, hi)`` of the 16-bit shard equal ``values`` (any float dtype; cast on the way).
        Returns the Futures of writes still in flight (swap files); ``values`` must stay untouched until then."""
        dst = self.param16[lo:hi]
        if dst.data_ptr() != values.data_ptr():  # fp32 training: the master slice *is* the weights
            dst.copy_(values)
        return []

    def ensure_grad(self) -> None:
        """Make sure the gradient shard exists (zeros) before reductions add into it."""
        if self.grad.numel() != self.layout.shard_numel:
            self.grad = torch.zeros(self.layout.shard_numel, dtype=self._grad_dtype, device=self._device)
            self.grad_fresh = True

    def clear_grad(self) -> None:
        """After the step: zero a persistent shard, free a transient one."""
        if self.persistent_grad:
            self.grad.zero_()
        else:
            self.grad = self.grad.new_empty(0)
        self.grad_fresh = True

    def publish(self, bucket_numel: int, group=None) -> None:
        """Write the updated 16-bit shards of every rank back into the full parameters (all-gather by buckets of
        at most ``bucket_numel`` elements and :data:`~hf_zero.comm.buckets.BUCKET_CAP_BYTES`)."""
        if self.world_size == 1:
            return  # the parameters are views of param16 (see _bind_params)
        bucket_numel = capped_bucket_numel(bucket_numel, self.param16.element_size())
        ranges = bucket_ranges(self.layout.shard_numels, self.world_size, bucket_numel)
        dtype = self.param16.dtype
        spans = [self.layout.span(start, stop) for start, stop in ranges]
        # one header check for every bucket (they are issued back to back, below), and the next bucket's gather
        # in flight while this one is unpacked
        faults.check_run([("all_gather", self.world_size * (hi - lo), dtype) for lo, hi in spans],
                         f"the publishing all-gathers of {len(spans)} buckets [{self.names[0]} ...]", group)
        pending = None
        for (start, stop), (lo, hi) in zip(ranges, spans):
            # each chunk of gathered rows straight into the parameters (through a shared ring: from shared memory)
            outs = [local_tensor(p.data).view(-1) for p in self.params[start:stop]]
            work = all_gather_delivered(self.param16[lo:hi], lambda a, b, rows, outs=outs, start=start:
                                        self.layout.unpack_columns(rows, start, outs, a), group=group)
            if pending is not None:
                pending.wait()
            pending = work
        if pending is not None:
            pending.wait()

    def load_master(self, master: torch.Tensor) -> None:
        """Replace the master shard (checkpoint load) and refresh the 16-bit copy."""
        self.master.copy_(master)
        if self.param16 is not self.master:
            self.param16.copy_(self.master)
