"""Channel pruning of a decoder LM's hidden size (Llama / Mistral / Qwen2-style: RMSNorm, no LayerNorm).

Config: the group's ``modules`` select the linear layers that *write* into the residual stream (e.g.
``["o_proj", "down_proj"]``); readers, token embedding and norms are found from the model. Cleaning removes the
pruned channels everywhere and sets ``config.hidden_size``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn

from hf_zero.config.errors import ConfigError

from ..install import installed_transform
from ..layer import wrap_linear
from ..matching import blamed_on, linear_names, match_group
from ..registry import CleanPlan, Slice
from .layer import ChannelMask, ChannelRows

if TYPE_CHECKING:
    from ..config import MethodConfig

__all__ = ["install", "plan_clean"]


def _hidden(model: nn.Module, cfg: "MethodConfig") -> int:
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if not isinstance(hidden, int):
        raise ConfigError(cfg.path, f"channel pruning needs a transformers model with config.hidden_size; "
                                    f"{type(model).__name__} has none")
    return hidden


def _parts(model: nn.Module, cfg: "MethodConfig", writers: list[str], hidden: int):
    """(readers, embeddings, norms) of the residual stream, or a ConfigError if the model is not supported."""
    readers = [n for n in linear_names(model) if n not in writers and model.get_submodule(n).in_features == hidden]
    embeddings, norms = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.embedding_dim == hidden:
            embeddings.append(name)
        elif isinstance(module, nn.LayerNorm) and module.normalized_shape == (hidden,):
            raise ConfigError(cfg.path, f"{name} is a LayerNorm: its mean over channels changes when channels are "
                                        f"removed; channel pruning supports RMSNorm models (Llama, Mistral, Qwen2)")
        elif type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None \
                and tuple(module.weight.shape) == (hidden,):
            norms.append(name)
    for name in writers:
        if model.get_submodule(name).out_features != hidden:
            raise ConfigError(f"{cfg.groups[0].path}.modules", f"{name} writes {model.get_submodule(name).out_features}"
                                                              f" features, not the hidden size {hidden}")
    if len(embeddings) != 1:
        raise ConfigError(cfg.path, f"expected one token embedding of width {hidden}, found {embeddings}")
    return readers, embeddings[0], norms


def install(model: nn.Module, cfg: "MethodConfig") -> list[str]:
    if len(cfg.groups) != 1:
        raise ConfigError(f"{cfg.path}.different_groups", "channel pruning takes exactly one group: the residual "
                                                          "stream is shared by every layer")
    (group,) = cfg.groups
    hidden = _hidden(model, cfg)
    writers = match_group(model, group)
    readers, embedding, _ = _parts(model, cfg, writers, hidden)
    shared = cfg.shared
    ratio = group.params.dense_ratio
    if round(ratio * hidden) < 1:
        raise ConfigError(f"{group.path}.params.dense_ratio", f"{ratio} of {hidden} channels keeps none")
    scored = [(model.get_submodule(n).weight, 0) for n in writers]
    scored += [(model.get_submodule(n).weight, 1) for n in readers]
    scored.append((model.get_submodule(embedding).weight, 1))
    schedule = shared.density_schedule(ratio)
    device = model.get_submodule(writers[0]).weight.device
    owner = ChannelMask(hidden=hidden, schedule=schedule, scored=scored).to(device)
    for i, name in enumerate(writers):
        module = wrap_linear(model, name)
        with blamed_on(group, name):
            module.add_weight_transform("channel_pruning", owner if i == 0 else ChannelRows(owner))
    owner._handles.append(model.get_submodule(embedding).register_forward_hook(owner.embedding_hook))
    return writers


def plan_clean(model: nn.Module, cfg: "MethodConfig") -> CleanPlan:
    (group,) = cfg.groups
    hidden = _hidden(model, cfg)
    writers = match_group(model, group)
    owner: ChannelMask | None = installed_transform(model, writers[0], cfg.method)
    if owner is None:
        return CleanPlan()
    readers, embedding, norms = _parts(model, cfg, writers, hidden)
    index = owner.kept_units()
    kept = int(index.numel())
    plan = CleanPlan()
    plan.slices += [Slice(n, 0, index) for n in writers] + [Slice(n, 1, index) for n in readers]
    tied = getattr(model, "get_output_embeddings", lambda: None)()
    tied = tied is not None and tied.weight is model.get_submodule(embedding).weight
    scale = math.sqrt(hidden / kept)

    def shrink(model: nn.Module) -> None:
        for handle in owner._handles:
            handle.remove()
        emb = model.get_submodule(embedding)
        emb.weight = nn.Parameter(emb.weight.detach()[:, index.to(emb.weight.device)].clone())
        emb.embedding_dim = kept
        for name in norms:
            norm = model.get_submodule(name)
            # RMS is now a mean over K channels, not H: w * sqrt(H/K) / sqrt(S/K + eps * H/K) equals the masked
            # model's w / sqrt(S/H + eps) exactly
            norm.weight = nn.Parameter(norm.weight.detach()[index.to(norm.weight.device)].clone() * scale)
            for attr in ("variance_epsilon", "eps"):
                if isinstance(getattr(norm, attr, None), float):
                    setattr(norm, attr, getattr(norm, attr) * hidden / kept)
        if tied:
            model.get_output_embeddings().weight = emb.weight

    plan.extra.append(shrink)
    head_dim = getattr(model.config, "head_dim", None) or hidden // model.config.num_attention_heads
    plan.updates += [("config", "head_dim", head_dim), ("config", "hidden_size", kept)]
    eps = getattr(model.config, "rms_norm_eps", None)
    if isinstance(eps, float):
        plan.updates.append(("config", "rms_norm_eps", eps * hidden / kept))
    return plan
