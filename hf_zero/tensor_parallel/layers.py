"""Tensor-parallel ``nn.Linear`` / ``nn.Embedding`` that compute on their local shards, Megatron style.

The parameters are DTensors exactly as torch's ``ColwiseParallel`` / ``RowwiseParallel`` lay them out (placement,
``full_state_dict``, checkpoints, ZeRO and the gradient norm read them as before), but the forward runs plain
``F.linear`` / ``F.embedding`` on ``param.to_local()`` with the collectives of regions.py, instead of DTensor
operations: a DTensor op pays a sharding propagation and a Python dispatch per call, forward and backward, which
on a CPU step of a small model costs more than the matmuls (issue #27's profile). Each parameter's gradient goes
back as a DTensor with the parameter's placement (``_LocalOf``), so ``param.grad`` is what it was.

    colwise      weight (out/tp, in)  Shard(0)   x whole  ── copy_to_tp ──> x @ W_r^T + b_r     (this rank's columns)
    rowwise      weight (out, in/tp)  Shard(1)   x_r      ── x_r @ W_r^T ── reduce_from_tp ──> + b  (whole)
                 sequence parallel: the partial sum is reduce-scattered to sequence shards instead
    vocab embed  weight (V/tp, H)     Shard(0)   ids      ── rows of this rank's ids, zeros elsewhere ── reduce
                 sequence parallel: reduce-scattered, returned as a DTensor sharded on the sequence
    vocab head   weight (V/tp, H)     Shard(0)   x whole  ── copy_to_tp ──> logits (B, S, V/tp) as a DTensor
                 Shard(-1) of the full vocabulary (the vocabulary-parallel loss reads it)

Each layer's ``forward`` is replaced on the instance (the module keeps its class: PEFT and transformers check it).
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.parallel import ParallelStyle

from hf_zero.tensor_parallel.regions import SharedCopy, copy_to_tp, reduce_from_tp

__all__ = ["LocalColwise", "LocalRowwise", "LocalVocabEmbedding", "LocalVocabHead"]

SEQ_DIM = 1  # [batch, sequence, hidden]; sequence.py's SEQ_DIM (not imported: sequence.py is a peer)


class _TPLayer:
    """What a local tensor-parallel layer's forward needs, kept on the module as ``hf_zero_tp_layer``."""

    def __init__(self, mesh, shared: SharedCopy | None, sequence_parallel: bool) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.copy = shared if shared is not None else SharedCopy(self.group)
        self.sequence_parallel = sequence_parallel


class _LocalOf(torch.autograd.Function):
    """``param.to_local()`` whose backward wraps the local gradient in the parameter's own spec (or ``grad_spec``)
    directly: ``to_local``'s backward goes through ``DTensor.from_local`` and a spec rebuild on every call (its
    placements check compares a list with a tuple), a millisecond per parameter per step under load."""

    @staticmethod
    def forward(ctx, param, grad_spec):
        ctx.grad_spec = grad_spec if grad_spec is not None else param._spec
        local = param._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        # a copy of the spec: sharding propagation may cache or modify the one it is given
        return DTensor(grad.contiguous(), copy.copy(ctx.grad_spec), requires_grad=False), None


def _local(p: torch.Tensor | None, grad_placements=None) -> torch.Tensor | None:
    """This rank's shard of parameter ``p`` (a DTensor) for the local compute, its gradient going back as a DTensor
    laid out like ``p`` (``grad_placements``: a Partial gradient, summed where the engine reads it)."""
    if not isinstance(p, DTensor):
        return p
    if not (torch.is_grad_enabled() and p.requires_grad):
        return p._local_tensor
    spec = None
    if grad_placements is not None:
        spec = DTensorSpec(p.device_mesh, tuple(grad_placements), tensor_meta=p._spec.tensor_meta)
    return _LocalOf.apply(p, spec)


class _LocalStyle(ParallelStyle):
    """Shard the module's parameters as ``placements`` says and make its ``forward`` the subclass's
    ``_forward(module, input)``."""

    module_type: type = nn.Linear
    placements: dict[str, Placement]

    def __init__(self, *, shared: SharedCopy | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.shared = shared
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, self.module_type):
            raise ValueError(f"hf_zero: {type(self).__name__} applies to {self.module_type.__name__}, got "
                             f"{type(module).__name__}")
        for name, param in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(param.detach(), device_mesh, [self.placements[name]],
                                   src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        module.hf_zero_tp_layer = _TPLayer(device_mesh, self.shared, self.sequence_parallel)
        module.forward = types.MethodType(type(self)._forward, module)
        return module


class LocalColwise(_LocalStyle):
    """Column parallel ``nn.Linear``: whole input, this rank's output features (attention heads, MLP units)."""

    placements = {"weight": Shard(0), "bias": Shard(0)}

    @staticmethod
    def _forward(module, x):  # x (.., in) whole -> (.., out/tp)
        state = module.hf_zero_tp_layer
        return F.linear(state.copy(x), _local(module.weight), _local(module.bias))


class LocalRowwise(_LocalStyle):
    """Row parallel ``nn.Linear``: this rank's input features, output summed over the TP group (sequence parallel:
    reduce-scattered to this rank's sequence shard)."""

    placements = {"weight": Shard(1), "bias": Replicate()}

    @staticmethod
    def _forward(module, x):  # x (.., in/tp) -> (.., out) whole, or (B, S/tp, out) under sequence parallelism
        state = module.hf_zero_tp_layer
        partial = F.linear(x, _local(module.weight))
        if state.sequence_parallel:
            out = DTensor.from_local(partial, state.mesh, (Partial(),), run_check=False)
            out = out.redistribute(placements=(Shard(SEQ_DIM),)).to_local()
            # the bias's gradient covers this rank's tokens only: a partial sum, reduced where gradients are read
            bias = _local(module.bias, grad_placements=(Partial(),))
        else:
            out = reduce_from_tp(partial, state.group)
            bias = _local(module.bias)
        return out if bias is None else out + bias


class LocalVocabEmbedding(_LocalStyle):
    """``nn.Embedding`` split over the vocabulary (torch.chunk's split, as DTensor's ``Shard(0)``): each rank looks
    up the ids in its rows, zeros for the others, and the TP group sums the lookups."""

    module_type = nn.Embedding
    placements = {"weight": Shard(0)}

    @staticmethod
    def _forward(module, ids):  # ids (B, S) global -> (B, S, H), or a DTensor Shard(1) under sequence parallelism
        state = module.hf_zero_tp_layer
        weight = _local(module.weight)
        rows = weight.shape[0]
        start = state.mesh.get_local_rank() * -(-module.num_embeddings // state.mesh.size())
        outside = (ids < start) | (ids >= start + rows)
        local_ids = (ids - start).masked_fill(outside, 0)
        pad = module.padding_idx
        pad = pad - start if pad is not None and start <= pad < start + rows else None
        out = F.embedding(local_ids, weight, pad, module.max_norm, module.norm_type, module.scale_grad_by_freq,
                          module.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if state.sequence_parallel:
            whole = DTensor.from_local(out, state.mesh, (Partial(),), run_check=False)
            return whole.redistribute(placements=(Shard(SEQ_DIM),))
        return reduce_from_tp(out, state.group)


class LocalVocabHead(_LocalStyle):
    """The LM head split over the vocabulary: logits of this rank's vocabulary slice, returned as a DTensor
    ``Shard(-1)`` of the full vocabulary (no rank ever holds full logits; the vocabulary-parallel loss reads it).
    Under sequence parallelism the input (the final norm's sequence-sharded DTensor) is gathered first."""

    placements = {"weight": Shard(0), "bias": Shard(0)}

    @staticmethod
    def _forward(module, x):  # x (B, S, H) whole, or a DTensor Shard(1) -> logits DTensor (B, S, V) Shard(-1)
        state = module.hf_zero_tp_layer
        if isinstance(x, DTensor):
            x = x.redistribute(placements=(Replicate(),)).to_local()
        logits = F.linear(state.copy(x), _local(module.weight), _local(module.bias))
        shape = (*logits.shape[:-1], module.out_features)
        return DTensor.from_local(logits, state.mesh, (Shard(logits.ndim - 1),), run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())
