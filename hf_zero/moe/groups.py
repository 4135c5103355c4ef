"""Optimizer parameter groups for MoE models: DeepSpeed's ``is_moe_param`` and
``split_params_into_different_moe_groups_for_optimizer``.

Every group is split in two: its non-expert parameters stay, its expert parameters (marked by ``Experts``) move to
a new group per expert group name with the same hyperparameters plus ``"moe": True`` and ``"name": <group name>``;
groups larger than ``max_group_size`` elements are cut into several, as DeepSpeed does.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size: int | float = 178956971
                                                         ) -> list[dict[str, Any]]:
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: param_groups must be a dict, list "
                         f"or tuple of dicts with 'params', got {type(param_groups).__name__}")
    groups = [dict(g, params=list(g["params"])) for g in param_groups]
    names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    moe_groups: list[dict[str, Any]] = []
    for group in groups:
        for name in names:
            experts = [p for p in group["params"] if is_moe_param(p) and p.group_name == name]
            if not experts:
                continue
            hyper = {k: v for k, v in group.items() if k not in ("params", "name")}
            moe_groups.extend(_cut({**hyper, "moe": True, "name": name}, experts, max_group_size))
        group["params"] = [p for p in group["params"] if not is_moe_param(p)]
    return groups + moe_groups


def _cut(template: dict[str, Any], params: list[torch.Tensor], max_numel: int | float) -> list[dict[str, Any]]:
    """``params`` in consecutive groups of at most ``max_numel`` elements (a larger parameter goes alone)."""
    out, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > max_numel:
            out.append({**template, "params": current})
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        out.append({**template, "params": current})
    return out
