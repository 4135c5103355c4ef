"""PEFT LoRA adapters on tensor-parallel linears: split each adapter the way its base layer is split.

PEFT's LoRA layer computes ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` on whatever ``x`` it gets, so
the adapter pair must produce the same layout as the base layer's output from the same (local) input:

  column parallel base (x whole on every rank, output = this rank's columns):
      lora_A replicated (r x in, small), lora_B split along its output like the base weight (layers.py's
      LocalColwise). lora_B's input copy all-reduces the gradient flowing back into ``lora_A(x)``, so lora_A's
      gradient is the full one on every TP rank (a replicated parameter, counted once by the gradient norm).
  row parallel base (x = this rank's slice of the features, output summed over the TP ranks):
      lora_A split along its input like the base weight, its partial products summed over the TP group
      (LocalRowwise: an all-reduce of an r-wide activation), lora_B replicated. With sequence parallelism the
      base output is reduce-scattered to sequence shards, so lora_A's partial products are too (r-wide) and lora_B
      runs on this rank's tokens (SequenceParallel: whole weight, gradient summed over the TP group).
  fused [q | k | v] column parallel base (GPT-2's c_attn): lora_B's rows are permuted into the base weight's
      rank-major order before the split, and un-permuted by ``full_state_dict`` (recorded in ``TPInfo.fused``).

Frozen base weights stay sharded DTensors (``requires_grad`` is kept by the styles). Saved adapters come from
``full_state_dict`` (``engine.module_state_dict()``), whose tensors have the unsplit shapes, so
``peft_model.save_pretrained(dir, state_dict=...)`` writes ordinary adapter files.

Refused by name: adapters on the vocabulary-parallel embedding / LM head, and LoRA variants (DoRA, ...) whose
forward reads the whole base weight. Not supported on sharded layers: ``merge`` / ``merge_and_unload`` (save the
adapters and merge into the unsplit model). ``lora_dropout`` draws its mask per rank: on a column-parallel layer
the TP ranks agree only when seeded alike.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from hf_zero.tensor_parallel.layers import LocalColwise, LocalRowwise
from hf_zero.tensor_parallel.styles import fused_to_rank_major

__all__ = ["is_lora_layer", "parallelize_lora_layer", "peft_base_model"]


def peft_base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (``model`` itself otherwise)."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA wrapper (``base_layer`` plus ``lora_A`` / ``lora_B``)."""
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def parallelize_lora_layer(name: str, module: nn.Module, style: str, mesh: DeviceMesh, *,
                           sequence_parallel: bool = False, parts=None) -> dict[str, tuple]:
    """Split the adapters of LoRA layer ``name`` (its base layer already parallel with ``style``; ``parts``: a
    ``fused_colwise`` base layer's sub-parameters, whose ``lora_B`` rows are permuted the same way; of a
    ``fused_rowwise`` one, whose ``lora_A`` columns are).

    Returns the fused-permutation entries ``{param name: (parts, dim)}`` for ``TPInfo.fused``.
    """
    if len(getattr(module, "lora_embedding_A", ())) or style in ("vocab_embedding", "vocab_lm_head"):
        raise ValueError(f"hf_zero: module {name!r} carries LoRA adapters but is split over the vocabulary "
                         f"({style}); adapters on the embedding / LM head are not supported with tensor "
                         "parallelism: leave them out of target_modules")
    variants = sorted(a for a, v in getattr(module, "lora_variant", {}).items() if v is not None)
    if variants or len(getattr(module, "lora_magnitude_vector", ())):
        raise ValueError(f"hf_zero: module {name!r}: LoRA variants (DoRA and the like, adapters {variants}) read the "
                         "whole base weight in their forward and are not supported with tensor parallelism; "
                         "use plain LoRA")
    fused = {}
    for adapter in module.lora_A:
        lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
        if style == "colwise":
            parallelize_module(lora_b, mesh, LocalColwise())
        elif style == "rowwise" and sequence_parallel:
            parallelize_module(lora_a, mesh, LocalRowwise(sequence_parallel=True))
            parallelize_module(lora_b, mesh, SequenceParallel(use_local_output=True))
        elif style == "rowwise":
            parallelize_module(lora_a, mesh, LocalRowwise())
        elif style == "fused_rowwise":  # lora_A reads the base layer's input: its columns in the same order
            lora_a.weight.data = fused_to_rank_major(lora_a.weight.data, parts, mesh.size(), 1)
            fused[f"{name}.lora_A.{adapter}.weight"] = (parts, 1)
            parallelize_module(lora_a, mesh, LocalRowwise())
        elif style in ("fused_qkv_colwise", "fused_colwise"):
            tp, n = mesh.size(), 3 if style == "fused_qkv_colwise" else parts
            for pname, param in lora_b.named_parameters(recurse=False):
                param.data = fused_to_rank_major(param.data, n, tp, 0)  # (out, r) / (out,): rows in base order
                fused[f"{name}.lora_B.{adapter}.{pname}"] = (n, 0)
            parallelize_module(lora_b, mesh, LocalColwise())
        else:
            raise ValueError(f"hf_zero: module {name!r} carries LoRA adapters on a {style!r} tensor-parallel layer; "
                             "adapters are supported on colwise, rowwise and fused (fused_qkv_colwise, fused_colwise, "
                             "fused_rowwise) "
                             "layers")
    return fused
