"""``deepspeed.utils.groups``' expert-parallel getters, with DeepSpeed's signatures, over hf_zero's groups
(hf_zero/comm/expert_groups.py: the same rank layout, so the same rank holds the same experts).

Groups are named ``"ep_size_<n>"``; the engine creates them at initialize for every MoE layer. A script may also
create them itself with :func:`create_expert_and_data_parallel` (DeepSpeed's ``_create_expert_and_data_parallel``).
"""

from __future__ import annotations

from hf_zero.comm.expert_groups import (create_expert_and_data_parallel as _create, expert_group_names,
                                        expert_groups, get_max_expert_size, get_max_expert_size_name)

__all__ = ["create_expert_and_data_parallel", "get_expert_parallel_group", "get_expert_parallel_group_ranks",
           "get_expert_parallel_group_dict", "get_expert_data_parallel_group", "get_expert_data_parallel_group_ranks",
           "get_expert_data_parallel_group_dict", "get_expert_parallel_world_size", "get_expert_parallel_rank",
           "get_expert_parallel_src_rank", "get_expert_data_parallel_world_size", "get_expert_data_parallel_rank",
           "get_expert_broadcast_src_rank", "get_max_expert_size", "get_max_expert_size_name",
           "get_max_expert_parallel_group"]


def create_expert_and_data_parallel(expert_parallel_size_: int, mp_size=None, pp_size=None, mp_mode: str = "tp",
                                    use_data_before_expert_parallel_: bool = False, folding_spec=None) -> None:
    """DeepSpeed's ``_create_expert_and_data_parallel`` without model or pipeline parallelism (``mp_size``,
    ``pp_size`` 1 or None; AutoEP's ``folding_spec`` None): those layouts are not implemented in hf_zero."""
    if (mp_size or 1) > 1 or (pp_size or 1) > 1 or folding_spec is not None:
        raise NotImplementedError(f"hf_zero: _create_expert_and_data_parallel(mp_size={mp_size}, pp_size={pp_size}, "
                                  f"folding_spec={folding_spec!r}): expert parallelism beside model or pipeline "
                                  "parallelism is not implemented; call it with the expert-parallel size only")
    _create(expert_parallel_size_, use_data_before_expert_parallel_)


def get_expert_parallel_group(group_name: str):
    return expert_groups(group_name).ep_group


def get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(expert_groups(group_name).ep_ranks)


def get_expert_parallel_group_dict() -> dict:
    return {name: expert_groups(name).ep_group for name in expert_group_names()}


def get_expert_data_parallel_group(group_name: str):
    return expert_groups(group_name).edp_group


def get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(expert_groups(group_name).edp_ranks)


def get_expert_data_parallel_group_dict() -> dict:
    return {name: expert_groups(name).edp_group for name in expert_group_names()}


def get_expert_parallel_world_size(group_name: str) -> int:
    return expert_groups(group_name).ep_size


def get_expert_parallel_rank(group_name: str) -> int:
    return expert_groups(group_name).ep_rank


def get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of EP rank 0 of this rank's expert-parallel group."""
    return expert_groups(group_name).ep_ranks[0]


def get_expert_data_parallel_world_size(group_name: str) -> int:
    return expert_groups(group_name).edp_size


def get_expert_data_parallel_rank(group_name: str) -> int:
    return expert_groups(group_name).edp_rank


def get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank of EDP rank 0 of this rank's expert-data-parallel group (where its experts start from)."""
    return expert_groups(group_name).edp_ranks[0]


def get_max_expert_parallel_group():
    return get_expert_parallel_group(get_max_expert_size_name())
