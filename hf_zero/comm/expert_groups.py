"""The process groups of MoE expert parallelism, laid out as DeepSpeed's ``deepspeed.utils.groups`` lays them out.

    world of 4, ep_size 2 (default order):    expert-parallel (EP) groups       [0, 1] [2, 3]
                                              expert-data-parallel (EDP) groups [0, 2] [1, 3]
    world of 4, ep_size 2, use_data_before_expert_parallelism:
                                              EP groups [0, 2] [1, 3]           EDP groups [0, 1] [2, 3]

An EP group's ranks hold different experts (``num_experts / ep_size`` each) and exchange tokens with an all-to-all;
an EDP group's ranks hold the same experts and average their gradients. A rank's place in its EP group (its *EP
rank*) says which experts it holds: EP rank ``e`` holds global experts ``e * num_local .. (e + 1) * num_local - 1``,
so the same rank holds the same experts as under DeepSpeed, and the EDP group created ``e``-th is the one of EP rank
``e``. Groups are named ``"ep_size_<n>"`` (DeepSpeed's names; MoE layers of one ep_size share them), created once
per process, every rank creating every group in the same order (``new_group`` is collective over the world).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["ExpertGroups", "create_expert_and_data_parallel", "expert_groups", "expert_group_names",
           "release_expert_groups", "get_max_expert_size", "get_max_expert_size_name"]


@dataclass(frozen=True)
class ExpertGroups:
    """The groups of one ``ep_size`` as this rank sees them."""

    name: str                          # "ep_size_<ep_size>"
    ep_size: int
    ep_group: dist.ProcessGroup        # this rank's EP group (all-to-all of tokens)
    ep_ranks: tuple[int, ...]          # its global ranks, in EP-rank order
    edp_group: dist.ProcessGroup       # this rank's EDP group (expert gradients are reduced over it)
    edp_ranks: tuple[int, ...]         # its global ranks, in EDP-rank order
    all_edp_ranks: tuple[tuple[int, ...], ...]  # every EDP group's ranks, indexed by the EP rank it serves

    @property
    def ep_rank(self) -> int:
        return self.ep_ranks.index(dist.get_rank())

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)

    @property
    def edp_rank(self) -> int:
        return self.edp_ranks.index(dist.get_rank())


_GROUPS: dict[str, ExpertGroups] = {}


def create_expert_and_data_parallel(ep_size: int, use_data_before_expert_parallel: bool = False) -> ExpertGroups:
    """Create (once) the EP and EDP groups of ``ep_size``; collective over the world. ``ep_size`` must divide the
    world size."""
    if not dist.is_initialized():
        raise RuntimeError(f"MoE(ep_size={ep_size}): expert parallelism needs torch.distributed: launch with "
                           "torchrun / deepspeed and initialize the engine (or hf_zero.comm.init_distributed()) "
                           "before the first forward")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"MoE: ep_size must be a positive integer, got {ep_size!r}")
    world = dist.get_world_size()
    if world % ep_size:
        raise ValueError(f"MoE: ep_size={ep_size} does not divide the world size {world}: every rank must belong "
                         f"to exactly one expert-parallel group of {ep_size} ranks")
    name = f"ep_size_{ep_size}"
    if name in _GROUPS:
        return _GROUPS[name]
    rank = dist.get_rank()
    edp_size = world // ep_size
    if use_data_before_expert_parallel:  # D + E: EDP groups are consecutive ranks
        edp_lists = [tuple(range(e * edp_size, (e + 1) * edp_size)) for e in range(ep_size)]
        ep_lists = [tuple(range(d, world, edp_size)) for d in range(edp_size)]
    else:  # E + D (DeepSpeed's default): EP groups are consecutive ranks
        edp_lists = [tuple(range(e, world, ep_size)) for e in range(ep_size)]
        ep_lists = [tuple(range(d * ep_size, (d + 1) * ep_size)) for d in range(edp_size)]
    # DeepSpeed's creation order (EDP groups first, then EP groups): the same new_group sequence on every rank
    edp_mine = ep_mine = None
    for ranks in edp_lists:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            edp_mine = (group, ranks)
    for ranks in ep_lists:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            ep_mine = (group, ranks)
    groups = ExpertGroups(name, ep_size, ep_mine[0], ep_mine[1], edp_mine[0], edp_mine[1], tuple(edp_lists))
    _GROUPS[name] = groups
    return groups


def expert_groups(name: str) -> ExpertGroups:
    """The groups named ``name`` ("ep_size_<n>"); an error naming what is set up when they are not."""
    if name not in _GROUPS:
        have = sorted(_GROUPS) or "none"
        raise RuntimeError(f"no expert-parallel group named {name!r} in this process (set up: {have}); the engine "
                           "creates them for every MoE layer at initialize (DeepSpeed: MoE.set_deepspeed_parallelism)")
    return _GROUPS[name]


def expert_group_names() -> list[str]:
    return sorted(_GROUPS)


def get_max_expert_size() -> int | None:
    """The largest ep_size of the groups created (None when there are none)."""
    return max((g.ep_size for g in _GROUPS.values()), default=None)


def get_max_expert_size_name() -> str:
    return f"ep_size_{get_max_expert_size()}"


def release_expert_groups() -> None:
    """Forget the groups (after ``destroy_process_group``, or between tests); the next creation makes new ones."""
    _GROUPS.clear()
