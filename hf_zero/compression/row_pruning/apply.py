"""Row pruning: mask output rows (neurons) of the selected linears; cleaning removes them, together with the same
rows of related modules of equal width (an MLP's gate projection) and the matching input columns of the related
modules that read them (the down projection), and updates ``config.intermediate_size``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from hf_zero.config.errors import ConfigError

from ..layer import CompressedLinear, wrap_linear
from ..masking import UnitMask
from ..matching import blamed_on, find_related, match_group
from ..registry import CleanPlan, Slice
from ..schedule import DensitySchedule
from ..structured import check_keeps_some as _check_keeps_some, config_of, uniform_count

if TYPE_CHECKING:
    from ..config import MethodConfig

__all__ = ["install", "plan_clean"]

_SIZE_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "d_ff")


def install(model: nn.Module, cfg: MethodConfig) -> list[str]:
    shared = cfg.shared
    touched: list[str] = []
    for group in cfg.groups:
        schedule = DensitySchedule(group.params.dense_ratio, shared.schedule_offset, shared.schedule_offset_end,
                                   shared.schedule_offset_stride)
        for name in match_group(model, group):
            module = wrap_linear(model, name)
            rows = module.out_features
            for rel in find_related(model, name, group.related_modules, group):
                r = model.get_submodule(rel)
                if r.in_features != rows and r.out_features != rows:
                    raise ConfigError(f"{group.path}.related_modules",
                                      f"{rel} {tuple(r.weight.shape)} neither reads nor matches the {rows} rows of "
                                      f"{name}")
            _check_keeps_some(group, rows, "rows")
            mask = UnitMask(weight=module.weight, axis="row", num_units=rows, method=shared.method,
                            schedule=schedule, mask_bias=True)
            with blamed_on(group, name):
                module.add_weight_transform("row_pruning", mask)
            touched.append(name)
    return touched


def plan_clean(model: nn.Module, cfg: MethodConfig) -> CleanPlan:
    plan = CleanPlan()
    kept: dict[str, int] = {}
    original = set()
    for group in cfg.groups:
        for name in match_group(model, group):
            module = model.get_submodule(name)
            if not isinstance(module, CompressedLinear) or "row_pruning" not in module.weight_transforms:
                continue
            index = module.weight_transforms["row_pruning"].kept_units()
            rows = module.out_features
            plan.slices.append(Slice(name, 0, index))
            for rel in find_related(model, name, group.related_modules, group):
                r = model.get_submodule(rel)
                # a related module reads the pruned rows (input columns) unless it is their twin (gate vs up)
                plan.slices.append(Slice(rel, 1 if r.in_features == rows else 0, index))
            kept[name] = int(index.numel())
            original.add(rows)
    config = config_of(model)
    count = uniform_count(kept, "rows kept by row_pruning") if kept else None
    if config is not None and count is not None and len(original) == 1:
        width = original.pop()
        for key in _SIZE_KEYS:
            if getattr(config, key, None) == width:
                plan.updates.append(("config", key, count))
    return plan
