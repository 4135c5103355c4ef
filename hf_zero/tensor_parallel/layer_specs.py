"""DeepSpeed's configurable AutoTP: ``tensor_parallel.partition_config`` and ``tensor_parallel.preset_model``,
translated once into a typed list of layer specs and, for a given model, into an hf_zero plan (plans.py's
``{module name: style}``).

    "tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": false, "layer_specs": [
        {"patterns": [".*\\\\.qkv\\\\.weight$"], "partition_type": "column", "shape": [[512, 128, 128], -1]},
        {"patterns": [".*\\\\.o_proj\\\\.weight$"], "partition_type": "row"}]}}

A spec names parameters by regular expressions matched (``re.match``, anchored at the start only, as DeepSpeed
does) against ``<module name>.weight``; the first spec that matches a module decides it. For each module with a
2-D weight (``nn.Linear``, transformers' ``Conv1D``):

    partition_type column           "colwise": this rank's output features
        + gather_output: true       "colwise_gather_output": output gathered whole on every rank
        + shape [n, -1]             "fused_colwise": n equal sub-parameters stacked on dim 0 ([gate | up]); each
                                    rank holds its slice of every one (weights permuted rank-major, saved whole)
        + shape [[a, b, c], -1]     the same with unequal sub-parameters (a grouped-query [q | k | v])
    partition_type row              "rowwise": this rank's input features, output summed over the TP group
        + shape [-1, n] / [-1, [a, b]]  "fused_rowwise": the input is a concatenation of sub-parameters ([attention
                                    | MLP] outputs, each column-split): columns permuted rank-major, bias whole
    partition_type skip             left whole; + grad_allreduce: true -> "replicated_with_grad_allreduce"
    model_types: [...]              the spec applies only when the model's ``config.model_type`` is listed
    no spec matches                 left whole (``strict_mode: true``: an error naming the module)

The LM head (a module whose last name is in ``lm_head_patterns``, default ``lm_head`` / ``embed_out``) and the
input embedding follow ``vocab_parallel_lm_head`` as without a partition_config (hf_zero's default: both split over
the vocabulary with the vocabulary-parallel loss); with it false, the head's spec decides (column + gather_output;
row: "rowwise_replicated_input", the logits summed whole, and a tied embedding "hidden_embedding"; or skip).
``preset_model`` names a built-in table (llama, qwen2, mixtral, deepseek_v2, bloom, chatglm, phi3); with a
partition_config too, ``use_default_specs: true`` puts the custom specs first and the preset's after them,
``false`` uses the custom specs alone -- DeepSpeed 0.19.8's rules.

Refused, each naming the key: a sub-parameter ``shape`` with a ``partition_dim`` other than the layer's split dim,
shapes of more than two dimensions (DeepSpeed's MoE expert views), a ``shape`` on a row-parallel LM head (DeepSpeed
raises NotImplementedError), ``grad_allreduce`` on a split layer, and a ``shape`` on a fused projection whose
model code cannot run split (``_UNSPLITTABLE``): GPT-NeoX / BLOOM store ``query_key_value`` per head
(``[q_h, k_h, v_h]`` for each head h), so the blocks ``shape`` describes are not there and the split would hand each
rank a mix of heads its row-parallel output projection does not expect -- DeepSpeed trains that spec (its DeepSpeedExamples AutoTP example for Pythia carries it) without an
error, on a different function than the model's: on a tiny GPT-NeoX its first loss is 4.893878 where the model's is
4.898342 (docs/tensor_parallel.md); Phi-3 slices ``qkv_proj``'s output at the config's full sizes, so DeepSpeed's
own ``phi3`` preset fails in the forward with a shape error (hf_zero names the cause instead).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from torch import nn

from hf_zero.config.errors import ConfigError, check_keys, closest
from hf_zero.tensor_parallel.adapters import is_lora_layer

__all__ = ["LayerSpec", "LayerSpecs", "PRESETS", "parse_layer_specs", "plan_from_specs"]

logger = logging.getLogger("hf_zero")

_SECTION = "tensor_parallel.partition_config"
_TYPES = ("column", "row", "skip")
_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output", "grad_allreduce")
_CONFIG_KEYS = ("layer_specs", "use_default_specs", "strict_mode", "lm_head_patterns", "tp_size",
                "embedding_partition_dim")
# fused projections whose transformers code a sub-parameter split cannot serve: model type -> (module name
# pattern, why, what to do instead)
_PER_HEAD = ("stores that projection per head ([q_h, k_h, v_h] for each head h): each rank would get a mix of heads "
             "that its row-parallel output projection does not expect, and train a different function than the "
             "model's (DeepSpeed 0.19.8 accepts this spec and does that: docs/tensor_parallel.md)",
             'Remove "shape" from the spec: a plain column split keeps whole heads on each rank')
_UNSPLITTABLE = {
    "gpt_neox": (r"query_key_value", *_PER_HEAD),
    "bloom": (r"query_key_value", *_PER_HEAD),
    "phi3": (r"qkv_proj", "slices that projection's output at the config's full sizes (num_attention_heads * "
             "head_dim), which a rank's slice does not have (DeepSpeed 0.19.8's preset fails in the forward: 'mat1 "
             "and mat2 shapes cannot be multiplied')", 'Leave the attention whole (partition_type "skip" for '
             "qkv_proj and o_proj) and split the MLP"),
}


@dataclass(frozen=True)
class LayerSpec:
    """One entry of ``layer_specs``, checked."""

    patterns: tuple[str, ...]
    partition_type: str = "column"                 # column | row | skip
    parts: int | tuple[int, ...] | None = None     # sub-parameters on the split dim (from shape), None: plain
    model_types: tuple[str, ...] | None = None
    gather_output: bool = False
    grad_allreduce: bool = False
    where: str = _SECTION                          # the key this spec came from, for errors

    def matches(self, param_name: str, model_type: str | None) -> bool:
        if self.model_types is not None and (model_type or "").lower() not in self.model_types:
            return False
        return any(re.match(p, param_name) for p in self.patterns)


@dataclass(frozen=True)
class LayerSpecs:
    """The specs a run applies, in priority order, and how unmatched layers are treated."""

    specs: tuple[LayerSpec, ...]
    strict: bool = False
    lm_head_patterns: tuple[str, ...] = ("lm_head", "embed_out")
    source: str = _SECTION

    def find(self, param_name: str, model_type: str | None) -> LayerSpec | None:
        hits = [s for s in self.specs if s.matches(param_name, model_type)]
        if len(hits) > 1:
            logger.debug("hf_zero: %s matches %d layer specs (%s); the first decides", param_name, len(hits),
                         [s.where for s in hits])
        return hits[0] if hits else None


def _spec(kind: str, *patterns: str, parts=None) -> LayerSpec:
    return LayerSpec(tuple(patterns), kind, parts, where="tensor_parallel.preset_model")


_LLAMA_LIKE = (
    _spec("row", r".*\.self_attn\.o_proj\.weight$"),
    _spec("column", r".*\.self_attn\.[qkv]_proj\.weight$"),
    _spec("row", r".*\.mlp\.down_proj\.weight$"),
    _spec("column", r".*\.mlp\.(up|gate)_proj\.weight$"),
)

# DeepSpeed 0.19.8's presets (module_inject/autotp_config.py AutoTPPresets), the same layers and split types
PRESETS: dict[str, tuple[LayerSpec, ...]] = {
    "llama": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "mixtral": (
        _spec("row", r".*\.self_attn\.o_proj\.weight$"),
        _spec("column", r".*\.self_attn\.[qkv]_proj\.weight$"),
        _spec("row", r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"),
        _spec("column", r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"),
        _spec("skip", r".*\.block_sparse_moe\.gate\.weight$"),
    ),
    "deepseek_v2": (
        _spec("row", r".*\.self_attn\.o_proj\.weight$"),
        _spec("skip", r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"),
        _spec("column", r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"),
        _spec("row", r".*\.mlp\.experts\.\d+\.down_proj\.weight$"),
        _spec("column", r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$"),
        _spec("skip", r".*\.mlp\.gate\.weight$"),
        _spec("row", r".*\.mlp\.shared_experts\.down_proj\.weight$"),
        _spec("column", r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$"),
    ),
    "bloom": (
        _spec("row", r".*\.self_attention\.dense\.weight$"),
        _spec("column", r".*\.self_attention\.query_key_value\.weight$"),
        _spec("row", r".*\.mlp\.dense_4h_to_h\.weight$"),
        _spec("column", r".*\.mlp\.dense_h_to_4h\.weight$"),
    ),
    "chatglm": (
        _spec("row", r".*\.self_attention\.dense\.weight$"),
        _spec("column", r".*\.self_attention\.query_key_value\.weight$", parts=3),
        _spec("row", r".*\.mlp\.dense_4h_to_h\.weight$"),
        _spec("column", r".*\.mlp\.dense_h_to_4h\.weight$", parts=2),
    ),
    "phi3": (
        _spec("row", r".*\.self_attn\.o_proj\.weight$"),
        _spec("column", r".*\.self_attn\.qkv_proj\.weight$", parts=3),
        _spec("row", r".*\.mlp\.down_proj\.weight$"),
        _spec("column", r".*\.mlp\.gate_up_proj\.weight$", parts=2),
    ),
}


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _strings(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, f"must be a list of strings, got {value!r}")
    return tuple(value)


def _parts(key: str, shape: Any, partition_dim: Any, kind: str) -> int | tuple[int, ...] | None:
    """The sub-parameters a ``shape`` describes on the split dim of a 2-D weight (dim 0, the output features, for a
    column-parallel layer: ``[n, -1]``; dim 1, the input features, for a row-parallel one: ``[-1, n]``)."""
    if partition_dim is not None and (not isinstance(partition_dim, int) or isinstance(partition_dim, bool)):
        raise ConfigError(f"{key}.partition_dim", f"must be an integer, got {partition_dim!r}")
    dim = 0 if kind == "column" else 1
    if shape is None:
        if partition_dim not in (None, dim) and kind != "skip":
            raise ConfigError(f"{key}.partition_dim", f"{partition_dim}: a {kind}-parallel layer splits weight dim "
                                                      f"{dim} (of nn.Linear's (out, in)); remove the key")
        return None
    if kind == "skip":  # DeepSpeed reads no shape for a layer it leaves whole
        logger.warning("hf_zero: %s.shape changes nothing: partition_type \"skip\" leaves the layer whole", key)
        return None
    if not isinstance(shape, (list, tuple)) or len(shape) != 2:
        raise ConfigError(f"{key}.shape", f"{shape!r}: hf_zero splits 2-D weights viewed as (sub-parameters, -1) "
                                          "or, row-parallel, (-1, sub-parameters); views of more dimensions (MoE "
                                          "expert stacks) are not supported")
    if partition_dim not in (None, dim):
        raise ConfigError(f"{key}.partition_dim", f"{partition_dim}: the sub-parameters of a {kind}-parallel layer "
                                                  f"are split on dim {dim} (its "
                                                  f"{'output' if dim == 0 else 'input'} features)")
    first, rest = shape[dim], shape[1 - dim]
    form = "[n, -1]" if dim == 0 else "[-1, n]"
    if not (rest == -1 or (isinstance(rest, int) and not isinstance(rest, bool) and rest > 0)):
        raise ConfigError(f"{key}.shape", f"{shape!r}: the entry beside the sub-parameters must be -1 or the "
                                          f"{'input' if dim == 0 else 'output'} size ({form})")
    if isinstance(first, int) and not isinstance(first, bool) and first > 0:
        return first
    if isinstance(first, (list, tuple)) and first and all(isinstance(n, int) and n > 0 for n in first):
        return tuple(first)
    raise ConfigError(f"{key}.shape", f"{shape!r}: entry {dim} must be a number of equal sub-parameters or a list of "
                                      f"their sizes ({form})")


def _parse_spec(key: str, raw: Any) -> LayerSpec:
    if not isinstance(raw, Mapping):
        raise ConfigError(key, f"must be an object, got {type(raw).__name__}")
    check_keys(raw, _SPEC_KEYS, key)
    patterns = _strings(f"{key}.patterns", raw.get("patterns", []))
    if not patterns:
        raise ConfigError(f"{key}.patterns", "is empty: a spec names its parameters by regular expressions")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise ConfigError(f"{key}.patterns", f"{p!r} is not a regular expression: {e}") from None
    kind = str(raw.get("partition_type", "column")).lower()
    if kind not in _TYPES:
        raise ConfigError(f"{key}.partition_type", f"{raw.get('partition_type')!r} is not one of {list(_TYPES)}")
    gather = _bool(f"{key}.gather_output", raw.get("gather_output", False))
    grad_allreduce = _bool(f"{key}.grad_allreduce", raw.get("grad_allreduce", False))
    parts = _parts(key, raw.get("shape"), raw.get("partition_dim"), kind)
    if gather and (kind != "column" or parts is not None):
        raise ConfigError(f"{key}.gather_output", "applies to a plain column-parallel layer (no shape), as in "
                                                  "DeepSpeed")
    if grad_allreduce and kind != "skip":
        raise ConfigError(f"{key}.grad_allreduce", f"applies to layers left whole (partition_type skip), not to a "
                                                   f"{kind}-parallel one")
    types = raw.get("model_types")
    types = None if types is None else tuple(t.lower() for t in _strings(f"{key}.model_types", types))
    return LayerSpec(patterns, kind, parts, types, gather, grad_allreduce, key)


def parse_layer_specs(partition_config: Any, preset_model: Any, autotp_size: int) -> LayerSpecs | None:
    """The specs ``partition_config`` / ``preset_model`` ask for (None when neither is set); a ConfigError names
    the first key that is wrong."""
    preset = None
    if preset_model is not None:
        if not isinstance(preset_model, str) or preset_model.lower() not in PRESETS:
            hint = closest(str(preset_model).lower(), PRESETS)
            raise ConfigError("tensor_parallel.preset_model", f"{preset_model!r} is not a preset" +
                              (f"; did you mean {hint!r}?" if hint else f"; presets: {sorted(PRESETS)}"))
        name = preset_model.lower()
        preset = tuple(replace(s, where=f"tensor_parallel.preset_model={name!r}") for s in PRESETS[name])
    if not partition_config:  # None or {}: absent, as DeepSpeed reads it
        return None if preset is None else LayerSpecs(preset, source=f"tensor_parallel.preset_model="
                                                                     f"{preset_model.lower()!r}")
    if not isinstance(partition_config, Mapping):
        raise ConfigError(_SECTION, f"must be an object, got {type(partition_config).__name__}")
    check_keys(partition_config, _CONFIG_KEYS, _SECTION)
    raw_specs = partition_config.get("layer_specs", [])
    if not isinstance(raw_specs, (list, tuple)):
        raise ConfigError(f"{_SECTION}.layer_specs", f"must be a list, got {type(raw_specs).__name__}")
    specs = tuple(_parse_spec(f"{_SECTION}.layer_specs[{i}]", s) for i, s in enumerate(raw_specs))
    use_default = _bool(f"{_SECTION}.use_default_specs", partition_config.get("use_default_specs", True))
    strict = _bool(f"{_SECTION}.strict_mode", partition_config.get("strict_mode", False))
    heads = _strings(f"{_SECTION}.lm_head_patterns", partition_config.get("lm_head_patterns",
                                                                          ["lm_head", "embed_out"]))
    size = partition_config.get("tp_size")
    if size is not None and size not in (1, autotp_size):
        logger.warning("hf_zero: %s.tp_size=%r changes nothing: tensor_parallel.autotp_size=%d decides the split "
                       "(as in DeepSpeed)", _SECTION, size, autotp_size)
    if "embedding_partition_dim" in partition_config:
        logger.warning("hf_zero: %s.embedding_partition_dim changes nothing (DeepSpeed 0.19.8 reads it nowhere): "
                       "the input embedding follows tensor_parallel.vocab_parallel_lm_head", _SECTION)
    source = _SECTION
    if preset is not None and use_default:
        specs, source = specs + preset, f"{_SECTION} + tensor_parallel.preset_model={preset_model.lower()!r}"
    elif preset is not None:
        logger.warning("hf_zero: tensor_parallel.preset_model=%r is not used: %s.use_default_specs is false (the "
                       "custom specs alone decide, as in DeepSpeed)", preset_model, _SECTION)
    if not specs:
        raise ConfigError(f"{_SECTION}.layer_specs", "is empty: nothing would be split")
    return LayerSpecs(specs, strict, heads, source)


def plan_from_specs(model: nn.Module, specs: LayerSpecs, *, vocab_parallel_head: bool = True
                    ) -> tuple[dict[str, str], dict[str, int | tuple[int, ...]]]:
    """``({module name: style}, {module name: sub-parameters})`` for ``model`` (a transformers model, names
    relative to it) under ``specs``; see the module docstring. Errors name the module and the spec's key."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    model_type = str(model_type).lower() if model_type else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    plan: dict[str, str] = {}
    fused: dict[str, int | tuple[int, ...]] = {}
    head_names = []
    lora = [n for n, m in model.named_modules() if is_lora_layer(m)]
    for name, module in model.named_modules():
        if name in lora:  # PEFT: the LoRA layer stands for its base layer (apply_tp splits both)
            module = module.base_layer
        elif any(name.startswith(f"{n}.") for n in lora):
            continue
        weight = module._parameters.get("weight")
        if not name or weight is None or module is emb or isinstance(module, nn.Embedding):
            continue
        spec = specs.find(f"{name}.weight", model_type)
        if weight.dim() != 2:  # norms and the like: whole; grad_allreduce sums their gradients (Qwen3's q_norm)
            if spec is not None and spec.grad_allreduce:
                plan[name] = "replicated_with_grad_allreduce"
            continue
        if name.rsplit(".", 1)[-1] in specs.lm_head_patterns and isinstance(module, nn.Linear):
            head_names.append(name)
            style = _head_style(name, spec, vocab_parallel_head)
            if style is not None:
                plan[name] = style
            continue
        if spec is None:
            if specs.strict:
                raise ValueError(f"hf_zero: {name}.weight ({type(module).__name__}) matches no spec of "
                                 f"{specs.source} and {_SECTION}.strict_mode is true; add a spec for it (or "
                                 "partition_type \"skip\")")
            continue
        if spec.partition_type == "skip":
            if spec.grad_allreduce:
                plan[name] = "replicated_with_grad_allreduce"
            continue
        if spec.parts is not None:
            if not isinstance(module, nn.Linear):
                raise ValueError(f"hf_zero: {spec.where}.shape: {name} is a {type(module).__name__}; sub-parameter "
                                 "splits apply to nn.Linear weights")
            known = _UNSPLITTABLE.get(model_type or "")
            if known is not None and re.search(known[0], name):
                key = spec.where if "preset_model" in spec.where else f"{spec.where}.shape"
                raise ValueError(f"hf_zero: {key} splits {name} into sub-parameters, but "
                                 f"{model_type} {known[1]}. {known[2]}")
            plan[name] = "fused_colwise" if spec.partition_type == "column" else "fused_rowwise"
            fused[name] = spec.parts
            continue
        if spec.partition_type == "row":
            plan[name] = "rowwise"
        else:
            plan[name] = "colwise_gather_output" if spec.gather_output else "colwise"
    if isinstance(emb, nn.Embedding):
        # split over the vocabulary as without a partition_config, except when tied to a head left whole (then
        # whole too) or split over the hidden features (row-parallel: the embedding shares that split)
        tied = [h for h in head_names if model.get_submodule(h).weight is emb.weight]
        emb_name = next(n for n, m in model.named_modules() if m is emb)
        if any(plan.get(h) == "rowwise_replicated_input" for h in tied):
            plan[emb_name] = "hidden_embedding"
        elif not any(h not in plan for h in tied):
            plan[emb_name] = "vocab_embedding"
    if not any(style not in ("vocab_embedding", "vocab_lm_head", "hidden_embedding", "rowwise_replicated_input")
               for style in plan.values()):
        raise ValueError(f"hf_zero: no layer of {type(model).__name__} (model_type={model_type!r}) matches the specs "
                         f"of {specs.source}: patterns {[p for s in specs.specs for p in s.patterns]} are matched "
                         "against '<module name>.weight' from the start (re.match); nothing would be split")
    return plan, fused


def _head_style(name: str, spec: LayerSpec | None, vocab_parallel_head: bool) -> str | None:
    """The LM head: vocabulary parallel under ``vocab_parallel_lm_head`` (a spec for it is overridden, as in
    DeepSpeed); otherwise the spec's column + gather_output, row (each rank multiplies its slice of the hidden
    features, the logits summed whole on every rank: DeepSpeed's LinearAllreduceWithReplicatedInput), or whole."""
    if vocab_parallel_head:
        if spec is not None and spec.partition_type != "column":
            logger.warning("hf_zero: tensor_parallel.vocab_parallel_lm_head overrides %s (partition_type %r) for "
                           "%s: the head is split over the vocabulary with the vocabulary-parallel loss", spec.where,
                           spec.partition_type, name)
        return "vocab_lm_head"
    if spec is None or spec.partition_type == "skip":
        return None
    if spec.partition_type == "row":
        if spec.parts is not None:  # DeepSpeed raises NotImplementedError for the same spec
            raise ValueError(f"hf_zero: {spec.where}.shape: a row-parallel LM head ({name}) is split on whole hidden "
                             "features; remove the shape")
        return "rowwise_replicated_input"
    if not spec.gather_output:
        raise ValueError(f"hf_zero: {spec.where}: a column-parallel LM head ({name}) without gather_output leaves "
                         "each rank a slice of the logits that the model's loss reads as whole (DeepSpeed 0.19.8 "
                         "fails in that loss: 'Expected input batch_size (16) to match target batch_size (32)' on "
                         "a Llama at TP 2); set gather_output true, or tensor_parallel.vocab_parallel_lm_head true "
                         "(the vocabulary-parallel loss)")
    return "colwise_gather_output"
