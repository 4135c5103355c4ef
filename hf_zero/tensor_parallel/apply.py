"""Shard a Hugging Face model in place over a TP mesh: ``apply_tp(model, tp_mesh)``.

Order of work (the model's code is never edited; only its parameters, hooks and a few size attributes change):
  1. resolve the plan (plans.py) and check the sizes it splits (attention heads, key/value heads, vocabulary);
  2. ``parallelize_module`` every planned module with its style: parameters become DTensors sharded over the TP
     mesh; ``nn.Linear`` / ``nn.Embedding`` then compute on their local shards with explicit collectives
     (layers.py), the other styles (GPT-2's ``Conv1D``, sequence parallelism's norms) convert inputs / outputs to
     DTensors at the module boundary;
  3. re-tie an LM head that shared its weight with the input embedding (both are sharded on the vocabulary);
  4. set the per-rank sizes modules read from attributes (GPT-2's ``split_size``), and install the
     vocabulary-parallel loss as ``model.loss_function`` when the head is vocabulary parallel.
The outcome is recorded in ``model.hf_zero_tp`` (a :class:`TPInfo`), which the engine, checkpoints and
``full_state_dict`` read.

A PEFT model (``get_peft_model`` before sharding) is sharded through its base model; its LoRA adapters on planned
linears are split with them (adapters.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hf_zero.tensor_parallel.adapters import is_lora_layer, parallelize_lora_layer, peft_base_model
from hf_zero.tensor_parallel.layer_specs import LayerSpecs, plan_from_specs
from hf_zero.tensor_parallel.layers import LocalColwise, LocalRowwise, LocalVocabEmbedding, LocalVocabHead
from hf_zero.tensor_parallel.loss import VocabParallelCausalLMLoss
from hf_zero.tensor_parallel.mesh import TPMesh
from hf_zero.tensor_parallel.plans import match_modules, resolve_plan
from hf_zero.tensor_parallel.regions import SharedCopy
from hf_zero.tensor_parallel.sequence import SEQ_DIM, SP_STYLES, install_sequence_check, sp_style
from hf_zero.tensor_parallel.styles import (Conv1DColwise, Conv1DRowwise, ReplicatedGradAllReduce,
                                            fused_to_rank_major)
from hf_zero.zero.init import unpartition_module

__all__ = ["apply_tp", "TPInfo", "tp_info", "is_tp_sharded", "check_adapters_sharded"]


@dataclass
class TPInfo:
    """How a model was sharded: read by checkpoints, ``full_state_dict`` and the engine."""

    mesh: DeviceMesh                       # 1-D, the TP dimension
    plan: dict[str, str]                   # module name -> style, as applied
    plan_source: str
    fused: dict[str, tuple[int, int]] = field(default_factory=dict)  # param name -> (parts, dim) permuted
    layout: TPMesh | None = None           # the (dp, tp) mesh when apply_tp got one (data-parallel groups)
    dtype: torch.dtype | None = None       # tp_model_init(dtype=...): checked against the engine's dtype
    sequence_parallel: bool = False        # residual stream split along the sequence between TP regions
    # id(pre-sharding Parameter) -> (a weak reference to it, the Parameter that replaced it): DTensor parameters are
    # new objects, where DeepSpeed's AutoTP keeps the objects and swaps their .data; this is how an optimizer built
    # before the sharding finds its parameters. Weak, so the replaced full-size tensors are not kept alive; keyed by
    # id because a tensor as a dict key would be compared with == (elementwise) by weakref's equality.
    replaced: dict[int, tuple[weakref.ref, nn.Parameter]] = field(default_factory=dict)

    def replacement(self, param: torch.Tensor) -> nn.Parameter | None:
        """The parameter that replaced ``param`` when the model was sharded, or None."""
        entry = self.replaced.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def current(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` as the model holds it now: its sharded replacement, or itself."""
        new = self.replacement(param)
        return param if new is None else new

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def group(self):
        return self.mesh.get_group()


def tp_info(model: nn.Module) -> TPInfo | None:
    """The :class:`TPInfo` of a model sharded by :func:`apply_tp` (looks through wrappers such as PEFT's)."""
    for m in model.modules():
        info = getattr(m, "hf_zero_tp", None)
        if isinstance(info, TPInfo):
            return info
    return None


def is_tp_sharded(t: torch.Tensor) -> bool:
    """Whether each TP rank holds a different part of ``t`` (False: a whole copy on every rank)."""
    return isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)


def check_adapters_sharded(model: nn.Module) -> None:
    """Refuse LoRA adapters added to layers that were already split (``get_peft_model`` after sharding): they were
    sized for the whole layer and would not match its shards. PEFT goes first, then tensor parallelism."""
    info = tp_info(model)
    if info is None:
        return
    inner = peft_base_model(model)
    for name in info.plan:
        module = inner.get_submodule(name)
        if is_lora_layer(module) and len(module.lora_A) and not any(
                isinstance(p, DTensor) for p in [*module.lora_A.parameters(), *module.lora_B.parameters()]):
            raise ValueError(f"hf_zero: module {name!r} got LoRA adapters after the model was made tensor parallel; "
                             "apply PEFT (get_peft_model) first, then shard (initialize with "
                             "tensor_parallel.autotp_size, tp_model_init or apply_tp)")


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _style(name: str, style: str, module: nn.Module, sp: bool = False, shared: SharedCopy | None = None):
    """The parallel style for ``style``; ``sp``: sequence parallelism (see sequence.py) changes the layouts at the
    boundaries of the TP regions -- row-parallel outputs reduce-scattered to sequence shards, the embedding's too,
    and the LM head gathering its sequence-sharded input. ``shared``: the column-parallel layers' shared input copy
    (regions.py), one per TP group.

    ``nn.Linear`` / ``nn.Embedding`` get layers.py's local-compute styles (plain matmuls, explicit collectives);
    GPT-2's ``Conv1D`` and the gathered-logits head keep their DTensor styles."""
    conv = _is_conv1d(module)
    if style in SP_STYLES:
        return sp_style(style)
    if style == "colwise":
        return Conv1DColwise() if conv else LocalColwise(shared=shared)
    if style == "rowwise":
        if sp:
            return Conv1DRowwise(output_placement=Shard(SEQ_DIM)) if conv else LocalRowwise(sequence_parallel=True)
        return Conv1DRowwise() if conv else LocalRowwise()
    if style == "colwise_gather_output":
        return ColwiseParallel(input_layouts=Shard(SEQ_DIM) if sp else Replicate(), output_layouts=Replicate())
    if style == "fused_qkv_colwise":
        return Conv1DColwise(fused_parts=3)
    if style == "fused_colwise":  # an nn.Linear whose rows apply_tp already permuted rank-major
        return LocalColwise(shared=shared)
    if style == "fused_rowwise":  # an nn.Linear whose columns apply_tp already permuted rank-major
        return LocalRowwise()
    if style == "rowwise_replicated_input":  # a row-parallel LM head: whole hidden states in, whole logits out
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "hidden_embedding":  # the embedding tied to that head: its hidden features split the same way
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"hf_zero: hidden_embedding applies to nn.Embedding; module {name!r} is "
                             f"{type(module).__name__}")
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "replicated_with_grad_allreduce":
        return ReplicatedGradAllReduce()
    if style == "vocab_embedding":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"hf_zero: vocab_embedding applies to nn.Embedding; module {name!r} is "
                             f"{type(module).__name__}")
        # under sp the rows are summed *and* split over the sequence: a reduce-scatter, a DTensor of the full shape
        return LocalVocabEmbedding(sequence_parallel=sp)
    if style == "vocab_lm_head":
        if not isinstance(module, nn.Linear):
            raise ValueError(f"hf_zero: vocab_lm_head applies to nn.Linear; module {name!r} is {type(module).__name__}")
        return LocalVocabHead(shared=shared, sequence_parallel=sp)
    raise ValueError(f"hf_zero: unknown tensor-parallel style {style!r} for module {name!r}")


def _check_sizes(model: nn.Module, matched: dict[str, str], tp: int) -> None:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    splits_heads = any(s in ("colwise", "fused_qkv_colwise", "fused_colwise") and ("attn" in n or "attention" in n)
                       for n, s in matched.items())
    for n, s in matched.items():
        if s in ("rowwise_replicated_input", "hidden_embedding"):
            width = model.get_submodule(n).weight.shape[1]
            if width % tp:
                raise ValueError(f"hf_zero: {n} ({s}) splits its {width} hidden features over the tensor-parallel "
                                 f"size {tp}, which must divide them")
    if splits_heads and heads is not None:
        if heads % tp:
            raise ValueError(f"hf_zero: tensor parallel size {tp} must divide num_attention_heads={heads} "
                             "(each rank computes whole heads)")
        if kv_heads % tp:
            raise ValueError(f"hf_zero: tensor parallel size {tp} must divide num_key_value_heads={kv_heads} "
                             "(grouped-query attention: each rank keeps whole key/value heads with their query "
                             "groups); pick a tensor parallel size dividing it")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh | TPMesh, *, plan: dict[str, str] | None = None,
             vocab_parallel_head: bool = True, sequence_parallel: bool = False,
             layer_specs: LayerSpecs | None = None) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh``; returns it. See the module docstring for what changes.

    ``tp_mesh``: the :class:`TPMesh` from :func:`~hf_zero.tensor_parallel.build_mesh` (the engine then knows the
    data-parallel groups too), or a 1-D device mesh of the TP ranks.

    ``plan``: ``{module pattern: style}`` replacing the resolved plan (see plans.py). ``vocab_parallel_head=False``
    gathers full logits on every rank instead of the vocabulary-parallel head and loss.

    ``sequence_parallel=True``: the residual stream between the TP regions is split along the sequence over the
    TP ranks (sequence.py); the sequence length must then be a multiple of the TP size.

    ``layer_specs``: DeepSpeed's ``partition_config`` / ``preset_model`` (layer_specs.py) decide the plan instead;
    its fused sub-parameter layers are split rank-major ([q_r | k_r | v_r] on rank r).
    """
    layout = tp_mesh if isinstance(tp_mesh, TPMesh) else None
    if layout is not None:
        tp_mesh = layout.tp_mesh
    if tp_info(model) is not None:
        raise ValueError("hf_zero: this model is already tensor parallel (apply_tp was called on it before)")
    if tp_mesh.ndim != 1:
        raise ValueError(f"hf_zero: apply_tp needs the 1-D tensor-parallel mesh (mesh['tp']), got {tp_mesh.ndim}-D")
    # built under zero.Init: the weights are whole again before they are cut (ZeRO-3 then partitions the TP shards)
    unpartition_module(model)
    outer, model = model, peft_base_model(model)  # PEFT: the transformers model inside (plan, embeddings, loss)
    before = dict(model.named_parameters(remove_duplicate=False))  # to map replaced parameters (TPInfo.replaced)
    parts: dict[str, int | tuple[int, ...]] = {}
    if layer_specs is not None and plan is None:
        if sequence_parallel:
            raise ValueError("hf_zero: sequence parallelism with layer specs (partition_config / preset_model) is "
                             "not supported")
        matched, parts = plan_from_specs(model, layer_specs, vocab_parallel_head=vocab_parallel_head)
        source = layer_specs.source
    else:
        resolved, source = resolve_plan(model, plan, vocab_parallel_head=vocab_parallel_head,
                                        sequence_parallel=sequence_parallel)
        matched = match_modules(model, resolved)
    if not matched:
        raise ValueError(f"hf_zero: the tensor-parallel plan from {source} names no module of "
                         f"{type(model).__name__}: {sorted(resolved)}")
    tp = tp_mesh.size()
    _check_sizes(model, matched, tp)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = emb is not None and head is not None and getattr(head, "weight", None) is emb.weight
    modules = dict(model.named_modules())
    fused = {}
    shared = SharedCopy(tp_mesh.get_group())
    for name, style in matched.items():
        module = modules[name]
        if style in ("fused_colwise", "fused_rowwise"):
            # permuted rank-major first: the split (Shard(0) of the rows / Shard(1) of the columns) then gives rank
            # r [p0_r | p1_r ..]
            fused.update(_permute_fused(name, module.base_layer if is_lora_layer(module) else module, parts[name],
                                        tp, 0 if style == "fused_colwise" else 1))
        if is_lora_layer(module):  # the base layer as planned, its adapters split to match
            base = module.base_layer
            parallelize_module(base, tp_mesh, _style(name, style, base, sequence_parallel, shared))
            fused.update(parallelize_lora_layer(name, module, style, tp_mesh, sequence_parallel=sequence_parallel,
                                                parts=parts.get(name)))
        else:
            frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
            parallelize_module(module, tp_mesh, _style(name, style, module, sequence_parallel, shared))
            for n in frozen:  # SequenceParallel re-creates parameters trainable (a PEFT-frozen norm would train)
                module.get_parameter(n).requires_grad_(False)
        if style == "fused_qkv_colwise":
            fused[f"{name}.weight"] = (3, 1)
            fused[f"{name}.bias"] = (3, 0)
            _set_split_size(model, name, tp)
    if tied:
        head.weight = emb.weight  # both vocabulary-sharded (Shard(0)): one DTensor, as before
    if matched.get(_name_of(model, head)) == "vocab_lm_head" and hasattr(type(model), "loss_function"):
        model.loss_function = VocabParallelCausalLMLoss()
    if sequence_parallel:
        prefix = getattr(model, "base_model_prefix", "")
        install_sequence_check(getattr(model, prefix, None) if prefix and hasattr(model, prefix) else model, tp_mesh)
    info = TPInfo(mesh=tp_mesh, plan=matched, plan_source=source, fused=fused, layout=layout,
                  sequence_parallel=sequence_parallel)
    for name, param in model.named_parameters(remove_duplicate=False):
        old = before.get(name)
        if old is not None and old is not param:
            info.replaced[id(old)] = (weakref.ref(old), param)
    model.hf_zero_tp = info
    return outer


@torch.no_grad()
def _permute_fused(name: str, linear: nn.Module, parts: int | tuple[int, ...], tp: int, dim: int) -> dict:
    """Reorder the features of a fused ``nn.Linear`` on ``dim`` (0: its outputs -- weight rows and bias --, for a
    column split; 1: its inputs -- weight columns --, for a row split; ``parts``: equal sub-parameters, or their
    sizes) rank-major, so that the split gives each rank its slice of every sub-parameter; the entries for
    ``TPInfo.fused``."""
    width = linear.weight.shape[dim]
    sizes = [width // parts] * parts if isinstance(parts, int) else list(parts)
    if sum(sizes) != width or any(n % tp for n in sizes):
        raise ValueError(f"hf_zero: {name} has {width} {'output' if dim == 0 else 'input'} features; the layer "
                         f"spec's sub-parameters {sizes} must add up to them and each be divisible by the "
                         f"tensor-parallel size {tp}")
    out = {}
    for pname, p in linear.named_parameters(recurse=False):
        if p.dim() > dim:  # a row split leaves the bias (added after the sum) whole
            p.data = fused_to_rank_major(p.data, parts, tp, dim)
            out[f"{name}.{pname}"] = (parts, dim)
    return out


def _name_of(model: nn.Module, module: nn.Module | None) -> str | None:
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def _set_split_size(model: nn.Module, proj_name: str, tp: int) -> None:
    """GPT-2's attention splits the fused projection by ``split_size`` (the full width): make it this rank's."""
    parent = model.get_submodule(proj_name.rsplit(".", 1)[0]) if "." in proj_name else model
    if hasattr(parent, "split_size"):
        parent.split_size //= tp
    if hasattr(parent, "num_heads"):
        parent.num_heads //= tp
