"""Which module gets which parallel style: a *plan*, ``{module pattern: style name}``.

Patterns are module names relative to the model, ``*`` standing for one name component (a layer index), as in
transformers' ``base_model_tp_plan``. Style names are transformers' (``colwise``, ``rowwise``,
``colwise_gather_output``, ``replicated_with_grad_allreduce``, and ``sequence_parallel`` under sequence parallelism)
plus hf_zero's own:

    vocab_embedding   nn.Embedding sharded over the vocabulary; each rank looks up its ids, the rows are summed
    vocab_lm_head     nn.Linear sharded over the vocabulary; returns logits as a DTensor sharded on the last dim,
                      consumed by the vocabulary-parallel cross-entropy (no rank ever holds full logits)
    fused_qkv_colwise a fused [q | k | v] projection, column parallel per part (GPT-2's c_attn)

Precedence: the ``plan`` argument, else the ``base_model_tp_plan`` the model's config declares (transformers ships
one for most decoder families), else hf_zero's own table below. The input embedding and LM head are always made
vocabulary parallel (transformers' ``colwise_gather_output`` head would put full logits on every rank).
With sequence parallelism the family's entries from sequence.py (norms, decoder layers, attention / MLP inputs)
are added to whichever plan was picked.
"""

from __future__ import annotations

import re
from typing import Mapping

from torch import nn

from hf_zero.tensor_parallel.sequence import SEQUENCE_KEY, SP_STYLES, with_sequence_plan

__all__ = ["OWN_PLANS", "resolve_plan", "match_modules", "SUPPORTED_STYLES"]

_LLAMA = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

# hf_zero's own base-model plans (relative to the base model, like transformers' base_model_tp_plan)
OWN_PLANS: dict[str, dict[str, str]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": {**_LLAMA, "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
              "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"},
    "gpt2": {
        "h.*.attn.c_attn": "fused_qkv_colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
}

SUPPORTED_STYLES = ("colwise", "rowwise", "colwise_gather_output", "replicated_with_grad_allreduce",
                    "vocab_embedding", "vocab_lm_head", "fused_qkv_colwise")


def _pattern(p: str) -> re.Pattern:
    return re.compile("^" + re.escape(p).replace(r"\*", r"[^.]+") + "$")


def match_modules(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """``{module name: style}`` for every module of ``model`` that a plan pattern names (first pattern wins)."""
    compiled = [(_pattern(p), style) for p, style in plan.items()]
    out = {}
    for name, _ in model.named_modules():
        for rx, style in compiled:
            if rx.match(name):
                out[name] = style
                break
    return out


def _base_prefix(model: nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix + "."
    return ""


def _module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def resolve_plan(model: nn.Module, plan: Mapping[str, str] | None = None, *, vocab_parallel_head: bool = True,
                 sequence_parallel: bool = False) -> tuple[dict[str, str], str]:
    """The full plan for ``model`` (patterns relative to ``model``) and where it came from (for logs / errors).

    ``vocab_parallel_head=False``: the LM head gathers full logits on every rank (``colwise_gather_output``, what
    DeepSpeed does unless ``vocab_parallel_lm_head`` is set) and the model keeps its own loss.
    ``sequence_parallel``: add the family's sequence-parallel entries (sequence.py ``SP_PLANS``; an error names
    the model when its family has none).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if plan is not None:
        resolved, source = dict(plan), "the plan argument"
    else:
        prefix = _base_prefix(model)
        declared = getattr(config, "base_model_tp_plan", None)
        if declared:
            base, source = dict(declared), f"{type(config).__name__}.base_model_tp_plan"
        elif model_type in OWN_PLANS:
            base, source = OWN_PLANS[model_type], f"hf_zero's plan for model_type={model_type!r}"
        else:
            raise ValueError(
                f"hf_zero: no tensor-parallel plan for {type(model).__name__} (model_type={model_type!r}): its config "
                f"declares no base_model_tp_plan and hf_zero has plans for {sorted(OWN_PLANS)}; pass "
                "plan={'<module pattern>': 'colwise' | 'rowwise' | ...} to apply_tp")
        resolved = {prefix + k: v for k, v in base.items()}
        emb = _module_name(model, model.get_input_embeddings()) if hasattr(model, "get_input_embeddings") else None
        if emb is not None:
            resolved[emb] = "vocab_embedding"
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head_name = _module_name(model, head)
        if head_name is not None and isinstance(head, nn.Linear):
            resolved[head_name] = "vocab_lm_head" if vocab_parallel_head else "colwise_gather_output"
    if sequence_parallel:
        resolved = with_sequence_plan(model, resolved, _base_prefix(model))
    else:
        sequence = sorted(k for k, v in resolved.items() if v in SP_STYLES)
        if sequence:
            raise ValueError(f"hf_zero: sequence-parallel styles for {sequence} (from {source}) split the residual "
                             f"stream along the sequence, which needs the whole sequence-parallel layout: set "
                             f"{SEQUENCE_KEY}: true (apply_tp(..., sequence_parallel=True)), or drop those entries")
    unknown = {k: v for k, v in resolved.items() if v not in SUPPORTED_STYLES + SP_STYLES}
    if unknown:
        raise ValueError(f"hf_zero: tensor-parallel styles {unknown} (from {source}) are not supported; supported: "
                         f"{list(SUPPORTED_STYLES)}. Pass plan=... to apply_tp to override those entries")
    return resolved, source
