"""Parallel styles torch does not ship: GPT-2's ``Conv1D`` (column / row / fused q|k|v) and parameters that stay
whole but whose gradients are partial sums (transformers' ``replicated_with_grad_allreduce``).

``Conv1D`` computes ``x @ W + b`` with ``W`` stored ``(in, out)`` -- the transpose of ``nn.Linear`` -- so column
parallel shards ``W`` on dim 1 and row parallel on dim 0. A fused projection (GPT-2's ``c_attn`` = [q | k | v])
cannot be cut in ``tp`` contiguous column blocks: rank ``r`` must hold ``[q_r | k_r | v_r]`` so that the model's own
``split(split_size)`` still yields its heads of q, k and v. :func:`fused_to_rank_major` permutes the columns into
that order before sharding; :func:`fused_from_rank_major` undoes it when a full weight is written out.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["Conv1DColwise", "Conv1DRowwise", "ReplicatedGradAllReduce", "fused_to_rank_major",
           "fused_from_rank_major"]


def _part_sizes(parts: int | Sequence[int], size: int) -> list[int]:
    """``parts`` equal blocks of a dim of ``size``, or the blocks' sizes as given (a fused [q | k | v] with
    grouped-query attention has a larger q)."""
    if isinstance(parts, int):
        return [size // parts] * parts
    sizes = [int(n) for n in parts]
    if sum(sizes) != size:
        raise ValueError(f"hf_zero: fused parts {sizes} add up to {sum(sizes)}, not the dimension's {size}")
    return sizes


def fused_to_rank_major(t: torch.Tensor, parts: int | Sequence[int], tp: int, dim: int) -> torch.Tensor:
    """Reorder ``dim`` of a fused ``[p_0 | p_1 | ... ]`` tensor (``parts``: that many equal blocks, or the blocks'
    sizes) so that its ``tp`` contiguous chunks are ``[p_0,r | p_1,r | ...]`` for r = 0..tp-1."""
    blocks = [b.chunk(tp, dim) for b in t.split(_part_sizes(parts, t.shape[dim]), dim)]
    return torch.cat([b[r] for r in range(tp) for b in blocks], dim)


def fused_from_rank_major(t: torch.Tensor, parts: int | Sequence[int], tp: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`fused_to_rank_major`."""
    sizes = _part_sizes(parts, t.shape[dim])
    pieces = t.split([n // tp for _ in range(tp) for n in sizes], dim)  # rank-major: rank r's piece of each part
    return torch.cat([pieces[r * len(sizes) + i] for i in range(len(sizes)) for r in range(tp)], dim)


def _to_dtensor(x, mesh, placement: Placement):
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (placement,), run_check=False)


class _Conv1DStyle(ParallelStyle):
    """Shared plumbing: check the module type, shard its parameters, convert inputs / outputs at the boundary."""

    weight_placement: Placement
    bias_placement: Placement
    input_placement: Placement       # how the module's (local) input is laid out across the TP ranks
    desired_input: Placement         # what the matmul needs
    output_placement: Placement      # what the module returns (to_local of it)

    def __init__(self, *, fused_parts: int = 1, output_placement: Placement | None = None):
        super().__init__()
        self.fused_parts = fused_parts
        if output_placement is not None:  # row parallel under sequence parallelism: Shard(1), a reduce-scatter
            self.output_placement = output_placement

    def _partition(self, name, module, mesh):
        tp = mesh.size()
        for pname, param in list(module.named_parameters(recurse=False)):
            full = param.detach()
            placement = self.weight_placement if pname == "weight" else self.bias_placement
            if self.fused_parts > 1 and isinstance(placement, Shard):
                full = fused_to_rank_major(full, self.fused_parts, tp, placement.dim)
            dt = distribute_tensor(full, mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))

    def _input_fn(self, mod, inputs, mesh):
        x = _to_dtensor(inputs[0], mesh, self.input_placement)
        if x.placements != (self.desired_input,):
            x = x.redistribute(placements=(self.desired_input,))
        return (x, *inputs[1:])

    def _output_fn(self, mod, outputs, mesh):
        if outputs.placements != (self.output_placement,):
            outputs = outputs.redistribute(placements=(self.output_placement,))
        return outputs.to_local()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if type(module).__name__ != "Conv1D" or not hasattr(module, "nf"):
            raise NotImplementedError(f"hf_zero: {type(self).__name__} applies to transformers' Conv1D, "
                                      f"got {type(module).__name__}")
        if self.fused_parts > 1:
            width = module.weight.shape[1]
            tp = device_mesh.size()
            if width % (self.fused_parts * tp):
                raise ValueError(f"hf_zero: fused projection of width {width} cannot be split in {self.fused_parts} "
                                 f"parts x {tp} tensor-parallel ranks")
        return distribute_module(module, device_mesh, self._partition, self._input_fn, self._output_fn)


class Conv1DColwise(_Conv1DStyle):
    """Column parallel ``Conv1D``: replicated input, output sharded on its last dim (this rank's heads / units)."""

    weight_placement = Shard(1)
    bias_placement = Shard(0)
    input_placement = Replicate()
    desired_input = Replicate()
    output_placement = Shard(-1)


class Conv1DRowwise(_Conv1DStyle):
    """Row parallel ``Conv1D``: input sharded on its last dim, output summed over the TP ranks (replicated; with
    ``output_placement=Shard(1)`` reduce-scattered to sequence shards instead)."""

    weight_placement = Shard(0)
    bias_placement = Replicate()
    input_placement = Shard(-1)
    desired_input = Shard(-1)
    output_placement = Replicate()


class ReplicatedGradAllReduce(ParallelStyle):
    """Parameters stay whole on every rank, but each rank's gradient covers only its shard of the activations
    (e.g. Qwen3's per-head ``q_norm`` applied to this rank's heads): the gradient is summed over the TP group.

    A tensor hook (not a post-accumulate hook) so that the sum is taken once per backward, before accumulation.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = device_mesh.get_group()

        def _sum(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        for p in module.parameters(recurse=False):
            if p.requires_grad:
                p.register_hook(_sum)
        return module
