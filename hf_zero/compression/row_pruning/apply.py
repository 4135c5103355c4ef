"""Row pruning: mask output rows (neurons) of the selected linears; cleaning removes them, together with the same
rows of related modules of equal width (an MLP's gate projection) and the matching input columns of the related
modules that read them (the down projection), and updates ``config.intermediate_size``."""

from __future__ import annotations

from typing import TYPE_CHECKING

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

_SIZE_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "d_ff")


def install(model: nn.Module, cfg: MethodConfig) -> list[str]:
    return install_each(model, cfg, _row_mask)


def _row_mask(model: nn.Module, cfg: MethodConfig, group: Group, name: str) -> UnitMask:
    linear = model.get_submodule(name)
    rows = linear.out_features
    for rel in find_related(model, name, group.related_modules, group):
        r = model.get_submodule(rel)
        if r.in_features != rows and r.out_features != rows:
            raise ConfigError(f"{group.path}.related_modules",
                              f"{rel} {tuple(r.weight.shape)} neither reads nor matches the {rows} rows of {name}")
    check_keeps_some(group, rows, "rows")
    return UnitMask(weight=linear.weight, axis="row", num_units=rows, method=cfg.shared.method,
                    schedule=cfg.shared.density_schedule(group.params.dense_ratio), mask_bias=True)


def plan_clean(model: nn.Module, cfg: MethodConfig) -> CleanPlan:
    plan = CleanPlan()
    kept: dict[str, int] = {}
    original = set()
    for group, name, mask in each_installed(model, cfg):
        index = mask.kept_units()
        rows = model.get_submodule(name).out_features
        plan.slices.append(Slice(name, 0, index))
        for rel in find_related(model, name, group.related_modules, group):
            r = model.get_submodule(rel)
            # a related module reads the pruned rows (input columns) unless it is their twin (gate vs up)
            plan.slices.append(Slice(rel, 1 if r.in_features == rows else 0, index))
        kept[name] = int(index.numel())
        original.add(rows)
    config = config_of(model)
    count = uniform_count(kept, "rows kept by row_pruning")
    if config is not None and count is not None and len(original) == 1:
        width = original.pop()
        for key in _SIZE_KEYS:
            if getattr(config, key, None) == width:
                plan.updates.append(("config", key, count))
    return plan
