"""Head pruning. During training, a head is masked where its output enters the model: the block of input columns
of the attention output projection (``o_proj`` / ``attention.output.dense``) that the head writes. Cleaning removes
those columns and the head's rows of the related query/key/value projections, and updates the attention module and
the transformers config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``).

Grouped-query attention: the unit pruned is a key/value group (one K/V head and the query heads that share it),
so the grouping stays valid; with plain multi-head attention a unit is one head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_zero.config.errors import ConfigError

from ..install import each_installed, install_each
from ..masking import UnitMask
from ..matching import find_related
from ..registry import CleanPlan, Slice
from ..structured import check_keeps_some, config_of, uniform_count

if TYPE_CHECKING:
    from ..config import Group, MethodConfig

__all__ = ["install", "plan_clean"]


def _geometry(model: nn.Module, cfg: MethodConfig, group: Group, name: str) -> tuple[int, int, int, list[str]]:
    """(num_heads, num_kv_heads, head_dim, related module names) for output projection ``name``."""
    out_proj = model.get_submodule(name)
    config = config_of(model)
    num_heads = cfg.shared.num_heads or getattr(config, "num_attention_heads", None)
    if not num_heads:
        raise ConfigError(f"{cfg.path}.shared_parameters.num_heads", "required: the model config does not say "
                                                                      "how many attention heads a layer has")
    if out_proj.in_features % num_heads:
        raise ConfigError(f"{cfg.path}.shared_parameters.num_heads",
                          f"{num_heads} heads do not divide the {out_proj.in_features} inputs of {name}")
    head_dim = out_proj.in_features // num_heads
    related = find_related(model, name, group.related_modules, group)
    kv_heads = num_heads
    for rel in related:
        r = model.get_submodule(rel)
        if r.out_features % head_dim:
            raise ConfigError(f"{group.path}.related_modules",
                              f"{rel} has {r.out_features} outputs, not a multiple of head_dim {head_dim}")
        kv_heads = min(kv_heads, r.out_features // head_dim)
    if num_heads % kv_heads:
        raise ConfigError(f"{group.path}.related_modules", f"{kv_heads} key/value heads do not divide {num_heads}")
    return num_heads, kv_heads, head_dim, related


def install(model: nn.Module, cfg: MethodConfig) -> list[str]:
    return install_each(model, cfg, _head_mask)


def _head_mask(model: nn.Module, cfg: MethodConfig, group: Group, name: str) -> UnitMask:
    num_heads, kv_heads, _, _ = _geometry(model, cfg, group, name)
    check_keeps_some(group, kv_heads, "key/value head groups" if kv_heads < num_heads else "heads")
    return UnitMask(weight=model.get_submodule(name).weight, axis="col", num_units=kv_heads,
                    method=cfg.shared.method, schedule=cfg.shared.density_schedule(group.params.dense_ratio),
                    mask_bias=False)


def plan_clean(model: nn.Module, cfg: MethodConfig) -> CleanPlan:
    plan = CleanPlan()
    kept_heads: dict[str, int] = {}
    kept_kv: dict[str, int] = {}
    head_dims = set()
    for group, name, mask in each_installed(model, cfg):
        num_heads, kv_heads, head_dim, related = _geometry(model, cfg, group, name)
        units = mask.kept_units()  # kept kv groups, ascending
        per_unit = num_heads // kv_heads
        q_heads = (units[:, None] * per_unit + torch.arange(per_unit, device=units.device)).flatten()
        q_cols = (q_heads[:, None] * head_dim + torch.arange(head_dim, device=units.device)).flatten()
        kv_cols = (units[:, None] * head_dim + torch.arange(head_dim, device=units.device)).flatten()
        plan.slices.append(Slice(name, 1, q_cols))
        for rel in related:
            width = model.get_submodule(rel).out_features
            plan.slices.append(Slice(rel, 0, q_cols if width == num_heads * head_dim else kv_cols))
        kept_heads[name] = int(q_heads.numel())
        kept_kv[name] = int(units.numel())
        head_dims.add(head_dim)
        parent = name.rpartition(".")[0]
        attn = model.get_submodule(parent) if parent else model
        for attr, value in (("num_heads", q_heads.numel()), ("num_attention_heads", q_heads.numel()),
                            ("num_key_value_heads", units.numel())):
            if isinstance(getattr(attn, attr, None), int):
                plan.updates.append((parent, attr, int(value)))
    config = config_of(model)
    heads = uniform_count(kept_heads, "heads kept by head_pruning")
    kv = uniform_count(kept_kv, "key/value heads kept by head_pruning")
    if config is not None and heads is not None and kv is not None and len(head_dims) == 1:
        # head_dim must become explicit: hidden_size // num_attention_heads no longer gives it
        plan.updates.append(("config", "head_dim", head_dims.pop()))
        plan.updates.append(("config", "num_attention_heads", heads))
        if getattr(config, "num_key_value_heads", None) is not None:
            plan.updates.append(("config", "num_key_value_heads", kv))
    return plan
