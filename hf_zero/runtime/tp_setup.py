"""Tensor parallelism as the engine sees it: which groups ZeRO runs over, and which gradients the norm skips.

``initialize`` calls :func:`setup_tensor_parallel` before anything looks at the model's parameters: it shards the
model (``tensor_parallel.autotp_size`` in the config) unless ``deepspeed.tp_model_init`` / ``apply_tp`` already did,
and returns the ``(dp, tp)`` layout. The engine then runs ZeRO over the data-parallel group (ranks holding the same
shard) and adds the norms of the TP group's other shards (``model_parallel_group``).

Gradient norm with TP: a sharded parameter's elements are spread over the TP ranks (sum the squares over the
group), but a replicated one (norms, row-parallel biases, position embeddings) has the same gradient on every TP
rank. :func:`replicated_spans` names those elements in each ZeRO shard so the ranks other than TP rank 0 leave
them out: each element of the unsplit model is counted exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_zero.config.errors import ConfigError
from hf_zero.tensor_parallel import apply_tp, tp_info
from hf_zero.tensor_parallel.apply import check_adapters_sharded, is_tp_sharded
from hf_zero.tensor_parallel.config import TPConfig
from hf_zero.tensor_parallel.loss import vocab_parallel_cross_entropy
from hf_zero.tensor_parallel.mesh import TPMesh
from hf_zero.tensor_parallel.state import full_state_dict

__all__ = ["TPLayout", "setup_tensor_parallel", "replicated_spans", "adopt_sharded_params"]


@dataclass(frozen=True)
class TPLayout:
    tp_size: int
    tp_rank: int
    tp_group: object
    dp_size: int
    dp_rank: int
    dp_group: object


def setup_tensor_parallel(model: nn.Module, tp_cfg: TPConfig, *, world_size: int | None = None,
                          pipeline_grid=None, mesh: TPMesh | None = None) -> TPLayout | None:
    """Shard ``model`` if the config asks and it is not yet; the layout, or None without tensor parallelism.

    ``pipeline_grid``: the model is a pipeline stage (3D); its (pp, dp, tp) device mesh decides the groups.
    ``mesh``: otherwise, the run's mesh (runtime/parallelize.py decides it: the mesh the model was sharded on, one
    over the groups of the caller's ``mpu``, or one built for the config). No mesh is built here.
    ``world_size``: when given, the ranks ``mesh`` must span.
    """
    if pipeline_grid is not None:
        return _setup_pipeline_stage(model, tp_cfg, pipeline_grid)
    if mesh is None:
        raise TypeError("setup_tensor_parallel: pass the run's mesh (runtime/parallelize.resolve_layout) or the "
                        "pipeline grid")
    if world_size is not None and mesh.mesh.size() != world_size:
        raise ValueError(f"setup_tensor_parallel: the mesh spans {mesh.mesh.size()} ranks, not the {world_size} "
                         "of the world")
    info = tp_info(model)
    if info is None and not tp_cfg.enabled:
        return None
    if info is None:
        apply_tp(model, mesh, vocab_parallel_head=tp_cfg.vocab_parallel_lm_head,
                 sequence_parallel=tp_cfg.sequence_parallel, layer_specs=tp_cfg.layer_specs)
        info = tp_info(model)
    elif tp_cfg.enabled and tp_cfg.size != info.size:
        raise ConfigError("tensor_parallel.autotp_size", f"{tp_cfg.size}, but the model was sharded over "
                                                         f"{info.size} ranks (tp_model_init / apply_tp)")
    elif tp_cfg.enabled and tp_cfg.sequence_parallel != info.sequence_parallel:
        raise ConfigError("tensor_parallel.sequence_parallel", f"{tp_cfg.sequence_parallel}, but the model was "
                                                               f"sharded with sequence_parallel="
                                                               f"{info.sequence_parallel} (tp_model_init / apply_tp); "
                                                               "make them agree")
    check_adapters_sharded(model)
    # the dp group even when it holds one rank: None would mean the whole world to the engine
    return TPLayout(mesh.tp_size, mesh.tp_rank, mesh.tp_group, mesh.dp_size, mesh.dp_rank, mesh.dp_group)


def adopt_sharded_params(model: nn.Module, model_parameters, optimizer) -> list | None:
    """Point what the caller built before the sharding at the sharded parameters; returns ``model_parameters``.

    DeepSpeed's AutoTP keeps each ``nn.Parameter`` object and swaps its ``.data`` for this rank's shard, so an
    optimizer built over ``model.parameters()`` before ``initialize`` (its AutoTP training example does that) and a
    ``list(model.parameters())`` taken before it both hold the trained parameters. Here sharded parameters are new
    (DTensor) objects; :attr:`TPInfo.replaced` maps each old one to its replacement, and this rewrites the client
    optimizer's ``param_groups`` in place (the same optimizer object, now over the model's parameters, as in
    DeepSpeed) and the ``model_parameters`` list. An optimizer that has state for a replaced parameter already
    stepped on the full tensor: refused, naming it, since that state has the unsharded shape."""
    info = tp_info(model)
    if info is None or not len(info.replaced):
        return model_parameters
    if model_parameters is not None:
        model_parameters = [dict(item, params=[info.current(p) for p in item["params"]]) if isinstance(item, dict)
                            else info.current(item) for item in model_parameters]
    if isinstance(optimizer, torch.optim.Optimizer):
        names = {p: n for n, p in model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                new = info.replacement(p)
                if new is not None and optimizer.state.get(p):
                    raise ValueError(f"hf_zero.initialize: the optimizer has state for "
                                     f"{names.get(new, 'a parameter')!r} from before tensor parallelism sharded it "
                                     f"(shape {tuple(p.shape)}); build the optimizer (or take its first step) after "
                                     "the sharding, or pass it as a config section or a callable")
            group["params"] = [info.current(p) for p in group["params"]]
    return model_parameters


def _setup_pipeline_stage(model: nn.Module, tp_cfg: TPConfig, grid) -> TPLayout | None:
    """3D: shard this stage's modules over the tensor axis of the pipeline's (pp, dp, tp) mesh (the run's mesh)."""
    mp = grid.model_parallel_size
    if not tp_cfg.enabled:
        if mp > 1 and hasattr(model, "cross_entropy_sum"):
            raise ConfigError("tensor_parallel.autotp_size", f"is unset, but the pipeline was wrapped with a "
                                                             f"tensor-parallel size of {mp} (wrap(tp_size=...) or "
                                                             f"the topology's 'model' axis); set autotp_size: {mp}")
        return None
    if not hasattr(model, "cross_entropy_sum"):
        raise ConfigError("tensor_parallel.autotp_size", "tensor parallelism inside pipeline stages applies to "
                                                         "Hugging Face models cut by hf_zero.pipeline.wrap(model, "
                                                         "num_stages, tp_size=N); a PipelineModule's layers have "
                                                         "no tensor-parallel plan")
    if tp_cfg.size != mp:
        raise ConfigError("tensor_parallel.autotp_size", f"{tp_cfg.size} differs from the pipeline's tensor-parallel "
                                                         f"size {mp}; pass tp_size={tp_cfg.size} to "
                                                         "hf_zero.pipeline.wrap (ranks are laid out pipe x data x "
                                                         "tensor)")
    if tp_cfg.sequence_parallel:
        raise ConfigError("tensor_parallel.sequence_parallel", "sequence parallelism inside pipeline stages is not "
                                                               "supported (stages exchange the whole hidden state); "
                                                               "turn it off for a pipeline model")
    if getattr(model, "virtual_stages", 1) > 1:
        raise ConfigError("pipeline.virtual_stages", "several virtual stages per rank with tensor parallelism are "
                                                     "not supported (untested); use virtual_stages 1")
    if tp_info(model) is None:
        layout = TPMesh(grid.device_mesh)
        apply_tp(model, layout, vocab_parallel_head=tp_cfg.vocab_parallel_lm_head, layer_specs=tp_cfg.layer_specs)
        if tp_cfg.vocab_parallel_lm_head:
            model.cross_entropy_sum = _vocab_parallel_ce_sum
        model.full_state_dict_fn = full_state_dict
    layout = tp_info(model).layout
    return TPLayout(layout.tp_size, layout.tp_rank, layout.tp_group, layout.dp_size, layout.dp_rank,
                    layout.dp_group)


def _vocab_parallel_ce_sum(logits, target):
    return vocab_parallel_cross_entropy(logits, target, ignore_index=-100, reduction="sum")


def replicated_spans(groups) -> dict[int, list[tuple[int, int]]]:
    """``{group index: [(lo, hi), ...]}``: the ranges of each ZeRO shard holding TP-replicated parameters."""
    out = {}
    for gi, g in enumerate(groups):
        spans: list[tuple[int, int]] = []
        for i, p in enumerate(g.params):
            if is_tp_sharded(p):
                continue
            lo, hi = g.layout.offsets[i], g.layout.offsets[i + 1]
            if spans and spans[-1][1] == lo:
                spans[-1] = (spans[-1][0], hi)
            else:
                spans.append((lo, hi))
        if spans:
            out[gi] = spans
    return out
