"""Sequence parallelism with tensor parallelism (Megatron-style; torchtitan's Llama plan): between the TP regions
the residual stream is split along the sequence over the TP group instead of being whole on every TP rank.

    embedding  ── reduce-scatter ──> [B, S/tp, H] ── norm, dropout, residual add on this rank's tokens
    attention / MLP input ── all-gather ──> [B, S, H] ── column-parallel q/k/v, up/gate (heads / units split)
    o_proj / down_proj (GPT-2 c_proj) ── reduce-scatter (not all-reduce) ──> [B, S/tp, H] ── residual add
    final norm on [B, S/tp, H] ── LM head all-gathers its input, logits split over the vocabulary as without SP

Same communication volume as plain TP (an all-reduce is a reduce-scatter plus an all-gather), the activations
between the regions shrink by tp. Norm weights stay whole on every rank (DTensor ``Replicate``) but each rank's
gradient covers only its tokens: DTensor sums them over the TP group (``SequenceParallel``).

The model code is not edited. Hugging Face decoders compute the attention mask, position ids, rotary cos/sin and
cache positions at model level from ``inputs_embeds.shape[1]`` and hand them to every layer: so what travels
between layers at model level is a DTensor sharded on the sequence, whose *global* shape is the full sequence
(those kwargs stay full and replicated), and each decoder layer converts only ``hidden_states`` to its local
shard on entry and back to a DTensor on exit (:class:`SequenceShardedBlock`). Attention / MLP gather the whole
sequence on entry (:class:`GatherSequenceInput`). Both take ``hidden_states`` positionally or by keyword, which
``PrepareModuleInput`` (a fixed positional arity) cannot.

Plans: :data:`SP_PLANS` adds, per model family, the styles below to the tensor-parallel plan; apply.py turns
``rowwise`` into ``RowwiseParallel(output_layouts=Shard(1))`` and makes the embedding / LM head sequence aware.
The sequence length must be a multiple of the TP size (:func:`install_sequence_check`).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["SP_PLANS", "SP_STYLES", "SEQUENCE_KEY", "SequenceShardedBlock", "GatherSequenceInput",
           "SequenceShardedOutput", "sequence_parallel_plan", "with_sequence_plan", "sp_style",
           "install_sequence_check"]

SEQUENCE_KEY = "tensor_parallel.sequence_parallel"
SEQ_DIM = 1  # [batch, sequence, hidden]

_LLAMA_SP = {
    "layers.*": "sequence_sharded_block",
    "layers.*.input_layernorm": "sequence_parallel",
    "layers.*.post_attention_layernorm": "sequence_parallel",
    "layers.*.self_attn": "gather_sequence_input",
    "layers.*.mlp": "gather_sequence_input",
    "norm": "sequence_parallel",
}

# relative to the base model, like OWN_PLANS; added to whichever TP plan resolve_plan picked
SP_PLANS: dict[str, dict[str, str]] = {
    "llama": _LLAMA_SP,
    "mistral": _LLAMA_SP,
    "qwen2": _LLAMA_SP,
    "qwen3": _LLAMA_SP,
    "gpt2": {
        "wpe": "sequence_sharded_output",  # whole position embeddings, each rank keeps its positions' rows
        "h.*": "sequence_sharded_block",
        "h.*.ln_1": "sequence_parallel",
        "h.*.ln_2": "sequence_parallel",
        "h.*.attn": "gather_sequence_input",
        "h.*.mlp": "gather_sequence_input",
        "ln_f": "sequence_parallel",
    },
}

# sequence_parallel is transformers' name (a norm on sequence shards); the others are hf_zero's
SP_STYLES = ("sequence_parallel", "sequence_sharded_block", "gather_sequence_input", "sequence_sharded_output")


def sequence_parallel_plan(model: nn.Module) -> dict[str, str]:
    """The sequence-parallel additions for ``model``'s family (patterns relative to the base model)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SP_PLANS:
        raise ValueError(f"hf_zero: {SEQUENCE_KEY} is not supported for {type(model).__name__} "
                         f"(model_type={model_type!r}): hf_zero has sequence-parallel plans for {sorted(SP_PLANS)}; "
                         "turn sequence_parallel off for this model (tensor parallelism works without it)")
    return SP_PLANS[model_type]


def _hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, bool]:
    if args:
        return args[0], True
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"], False
    raise ValueError("hf_zero: a sequence-parallel module was called without hidden_states")


def _replace(args: tuple, kwargs: dict, positional: bool, x: torch.Tensor) -> tuple[tuple, dict]:
    if positional:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


class SequenceShardedBlock(ParallelStyle):
    """A decoder layer: ``hidden_states`` arrives as a DTensor sharded on the sequence (full global shape) and runs
    through the layer as this rank's local ``[B, S/tp, H]`` shard; the output goes back to a sharded DTensor. The
    layer's other arguments (mask, positions, rotary cos/sin, cache) are untouched: built from the full sequence."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        shard = (Shard(SEQ_DIM),)

        def enter(mod, args, kwargs):
            x, positional = _hidden(args, kwargs)
            if not isinstance(x, DTensor):
                raise ValueError(f"hf_zero: {SEQUENCE_KEY}: decoder layer {type(mod).__name__} got a plain tensor "
                                 f"of shape {tuple(x.shape)} instead of the sequence-sharded hidden state; call the "
                                 "model as a whole (its embedding shards the sequence)")
            if x.placements != shard:
                x = x.redistribute(placements=shard)
            return _replace(args, kwargs, positional, x.to_local())

        def leave(mod, args, kwargs, out):
            if isinstance(out, tuple):  # older layers return (hidden_states, ...)
                return (DTensor.from_local(out[0], device_mesh, shard, run_check=False), *out[1:])
            return DTensor.from_local(out, device_mesh, shard, run_check=False)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True)
        return module


class GatherSequenceInput(ParallelStyle):
    """Attention / MLP: all-gather ``hidden_states`` (a sequence shard: DTensor or this rank's local tensor) into
    the whole sequence before the column-parallel projections; the backward reduce-scatters its gradient."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def enter(mod, args, kwargs):
            x, positional = _hidden(args, kwargs)
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(SEQ_DIM),), run_check=False)
            return _replace(args, kwargs, positional, x.redistribute(placements=(Replicate(),)).to_local())

        module.register_forward_pre_hook(enter, with_kwargs=True)
        return module


class SequenceShardedOutput(ParallelStyle):
    """A module with whole (replicated) parameters computed on the whole sequence, whose output joins the sharded
    residual stream (GPT-2's position embeddings): each rank keeps its positions' rows (a slice, no communication);
    the backward all-gathers the output's gradient, so the weight's gradient is the full one on every rank."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def leave(mod, args, out):
            whole = DTensor.from_local(out, device_mesh, (Replicate(),), run_check=False)
            return whole.redistribute(placements=(Shard(SEQ_DIM),))

        module.register_forward_hook(leave)
        return module


def install_sequence_check(base: nn.Module, mesh) -> None:
    """Refuse a sequence length that is not a multiple of the TP size before the embedding runs, and shard a
    caller's ``inputs_embeds`` (a whole tensor) on the sequence as the embedding would have."""
    tp = mesh.size()

    def check(mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        x = ids if ids is not None else embeds
        if x is None or x.ndim < 2:
            return None
        length = x.shape[1]
        if length % tp:
            raise ValueError(f"hf_zero: {SEQUENCE_KEY}: the sequence length {length} is not a multiple of the "
                             f"tensor-parallel size {tp} (each TP rank keeps length / {tp} tokens of the residual "
                             f"stream); pad the batch to a multiple of {tp} (e.g. the tokenizer's / data collator's "
                             f"pad_to_multiple_of={tp}) or turn sequence_parallel off")
        if embeds is not None and not isinstance(embeds, DTensor):
            whole = DTensor.from_local(embeds, mesh, (Replicate(),), run_check=False)
            return args, {**kwargs, "inputs_embeds": whole.redistribute(placements=(Shard(SEQ_DIM),))}
        return None

    base.register_forward_pre_hook(check, with_kwargs=True)


def sp_style(style: str) -> ParallelStyle:
    from torch.distributed.tensor.parallel import SequenceParallel

    if style == "sequence_parallel":  # replicated weight; input / output sharded on the sequence; grads summed
        return SequenceParallel(sequence_dim=SEQ_DIM, use_local_output=False)
    if style == "sequence_sharded_block":
        return SequenceShardedBlock()
    if style == "gather_sequence_input":
        return GatherSequenceInput()
    if style == "sequence_sharded_output":
        return SequenceShardedOutput()
    raise ValueError(style)


def with_sequence_plan(model: nn.Module, resolved: Mapping[str, str], prefix: str) -> dict[str, str]:
    """``resolved`` plus the family's sequence-parallel entries (its own entries win on the same pattern)."""
    extra = {prefix + k: v for k, v in sequence_parallel_plan(model).items()}
    return {**resolved, **{k: v for k, v in extra.items() if k not in resolved}}
