"""MoE expert parallelism as the engine sees it: the groups, which optimizer groups hold experts, the broadcast.

At initialize, as DeepSpeed's engine does, every module with ``set_deepspeed_parallelism`` (``MoE``) gets its
expert-parallel groups (hf_zero/comm/expert_groups.py). Expert parameters of a layer with ``ep_size > 1`` (marked
``allreduce=False``, ``group_name="ep_size_<n>"``) then differ between the ranks of an expert-parallel group, so:

- each optimizer parameter group holds either no such parameter or only those of one ``group_name`` (DeepSpeed's
  ``split_params_into_different_moe_groups_for_optimizer`` makes them; a config-built optimizer's groups are split
  here, as DeepSpeed's engine splits them; a client optimizer's mixed group is split at stage 0 only, staying one
  parameter group, and refused at stages 1/2, as DeepSpeed does); the expert groups become ZeRO groups over the
  expert-data-parallel (EDP) group (``ShardedGroup.expert``: the layer's :class:`ExpertGroups`);
- the initial broadcast sends expert parameters over their EDP group, from its first rank, and everything else
  over the data-parallel group from its first rank (DeepSpeed's ``_broadcast_model``).

What DeepSpeed 0.19.8 refuses is refused here by the same key: native MoE at ZeRO stage 3. Expert parallelism
beside pipeline or tensor parallelism (DeepSpeed's ``mpu`` paths) is not implemented in hf_zero and says so.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_zero import comm
from hf_zero.comm.expert_groups import ExpertGroups, expert_groups
from hf_zero.config.errors import ConfigError
from hf_zero.moe import MoE, is_moe_param
from hf_zero.zero.local import local_tensor

__all__ = ["setup_expert_parallel", "expert_placement", "split_plan_groups", "broadcast_module"]


def setup_expert_parallel(module: nn.Module, *, stage: int, process_group, tensor_parallel: bool,
                          pipeline: bool, data_before_expert: bool = False) -> dict[str, ExpertGroups]:
    """Give every MoE layer its groups; returns the expert-parallel ones (``ep_size > 1``) by group name.
    ``data_before_expert``: the config's ``use_data_before_expert_parallelism`` (DeepSpeed's D + E rank layout;
    groups an earlier call created, e.g. the script's own ``_create_expert_and_data_parallel``, are kept, as
    DeepSpeed keeps them)."""
    layers = [m for m in module.modules() if hasattr(m, "set_deepspeed_parallelism")]
    ep_sizes = sorted({m.ep_size for m in layers if isinstance(m, MoE) and m.ep_size > 1})
    if ep_sizes:
        what = f"MoE(ep_size={ep_sizes[0]})"
        if stage == 3:
            raise ConfigError("zero_optimization.stage",
                              f"3 with a native MoE layer ({what}): DeepSpeed 0.19.8 refuses native MoE at ZeRO "
                              "stage 3 as well (\"Native DeepSpeed MoE is not supported with ZeRO Stage 3\"); use "
                              "stage 0, 1 or 2 (hf_zero runs ep_size=1 MoE layers at stage 3)")
        if tensor_parallel or pipeline or process_group is not None:
            raise NotImplementedError(f"hf_zero: {what} beside pipeline or tensor parallelism is not implemented: "
                                      "expert parallelism runs over a data-parallel world of its own (ZeRO stages "
                                      "0-2, no mpu); use ep_size=1 there")
    for m in layers:
        m.set_deepspeed_parallelism(data_before_expert)
    return {f"ep_size_{n}": expert_groups(f"ep_size_{n}") for n in ep_sizes}


def _expert_name(p: torch.Tensor, groups: dict[str, ExpertGroups]) -> str | None:
    """The group name of an expert-parallel parameter (None: an ordinary one, or an ep_size=1 expert)."""
    if is_moe_param(p) and getattr(p, "group_name", None) in groups:
        return p.group_name
    return None


def expert_placement(params, groups: dict[str, ExpertGroups]) -> ExpertGroups | None:
    """Where an optimizer group's parameters live: None for ordinary ones, their expert groups for experts
    (:func:`split_plan_groups` made every group one or the other)."""
    name = next((n for n in (_expert_name(p, groups) for p in params) if n is not None), None)
    return groups[name] if name is not None else None


def split_plan_groups(plan, groups: dict[str, ExpertGroups], stage: int) -> list[int]:
    """Make each of ``plan.groups`` hold ordinary parameters only or one expert group's only, as DeepSpeed's engine
    does for an optimizer it builds from the config (``configure_moe_param_groups``): a mixed group keeps its
    ordinary parameters, and its experts follow as new groups with the same hyperparameters, ``"moe": True`` and
    ``"name"``. Returns, per resulting group, the index of the optimizer parameter group it belongs to.

    A client optimizer's groups are its own (schedulers hold them). At stage 0 a mixed one is split here too, but its
    parts stay one parameter group (``ZeroOptimizer(param_group_of=...)``: one dict holding each part's master), so
    the client's ``param_groups`` keep their number and hyperparameters -- DeepSpeed's stage 0 steps the client's
    optimizer as it is and reduces gradients per parameter (``_reduce_expert_gradients``). At stages 1/2 a mixed
    group is refused, naming the helper that splits it: DeepSpeed's ZeRO optimizer asserts the same
    (``_configure_moe_settings``: a group marked ``moe`` must hold MoE parameters only, and one must be marked)."""
    if not groups:
        return list(range(len(plan.groups)))
    out, owners = [], []
    for params, hyper in plan.groups:
        names = [_expert_name(p, groups) for p in params]
        kinds = set(names)
        first = owners[-1] + 1 if owners else 0  # this group's parameter-group index
        if len(kinds) <= 1:
            name = names[0] if params else None
            out.append((params, {**hyper, "moe": True, "name": name} if name is not None else hyper))
            owners.append(first)
            continue
        if plan.client is not None and stage > 0:
            raise ValueError(
                "hf_zero: the optimizer passed to initialize has a parameter group mixing expert-parallel MoE "
                f"parameters ({sorted(n for n in kinds if n is not None)}) with other parameters; build it from "
                "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(param_groups) (expert "
                "gradients are reduced over another process group than the rest), as DeepSpeed requires at "
                f"zero_optimization.stage {stage} (stage 0 accepts it)")
        one = plan.client is not None  # the client's group: its parts stay one parameter group
        parts = [([p for p, n in zip(params, names) if n is None], hyper)]
        parts += [([p for p, n in zip(params, names) if n == name], hyper if one else
                   {**hyper, "moe": True, "name": name}) for name in sorted(n for n in kinds if n is not None)]
        for i, part in enumerate(p for p in parts if p[0]):
            out.append(part)
            owners.append(first if one else first + i)
    plan.groups[:] = out
    return owners


def broadcast_module(module: nn.Module, groups: dict[str, ExpertGroups], process_group) -> None:
    """Every rank starts from its group's first rank's weights: expert-parallel parameters from the first rank of
    their EDP group (the ranks holding the same experts), everything else from the data-parallel group's first."""
    src = torch.distributed.get_global_rank(process_group, 0) if process_group is not None else 0
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            name = _expert_name(t, groups)
            if name is None:
                comm.broadcast(local_tensor(t.data), src=src, group=process_group)
            elif groups[name].edp_size > 1:
                comm.broadcast(local_tensor(t.data), src=groups[name].edp_ranks[0], group=groups[name].edp_group)
