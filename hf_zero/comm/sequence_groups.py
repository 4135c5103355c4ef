"""The process groups of Ulysses sequence parallelism (SP), and the getters DeepSpeed's ``mpu`` interface names.

    world of 4, sequence_parallel_size 2:   SP groups [0, 1] [2, 3]    (consecutive ranks: one sample each)
                                            sequence-data-parallel group [0, 1, 2, 3] (ZeRO shards over it)

The ranks of one SP group hold the same parameters and work on one sample, each on a slice of its sequence; the
SP groups are the data-parallel replicas. ZeRO partitions and averages over every rank (the sequence-data-parallel
group), because each rank computed a different part of the gradient.

This module is itself the ``mpu`` object ``UlyssesSPAttentionHF.register_with_transformers`` returns (as DeepSpeed
returns its ``parallel_state_sp`` module): ``initialize(mpu=...)`` and accelerate call the getters on it. The groups
are created once per process; asking again for the same size reuses them (accelerate and the Trainer may register
twice), another size is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["initialize_sequence_parallel", "sequence_parallel_is_initialized", "release_sequence_parallel",
           "get_sequence_parallel_group", "get_sequence_parallel_world_size", "get_sequence_parallel_rank",
           "get_sequence_data_parallel_group", "get_sequence_data_parallel_world_size",
           "get_sequence_data_parallel_rank"]


@dataclass(frozen=True)
class _SequenceGroups:
    size: int
    group: dist.ProcessGroup       # this rank's SP group
    data_group: dist.ProcessGroup  # every rank: SP x DP


_GROUPS: _SequenceGroups | None = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Split the world into groups of ``sequence_parallel_size`` consecutive ranks. Collective: every rank calls it."""
    global _GROUPS
    if not dist.is_initialized():
        raise RuntimeError("sequence parallelism needs torch.distributed: launch with torchrun / accelerate launch "
                           "and call hf_zero.comm.init_distributed() first")
    world = dist.get_world_size()
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int) \
            or sequence_parallel_size < 2:
        raise ValueError(f"sequence_parallel_size must be an integer > 1, got {sequence_parallel_size!r}")
    if world % sequence_parallel_size:
        raise ValueError(f"sequence_parallel_size {sequence_parallel_size} does not divide the world size {world}; "
                         "every rank must belong to exactly one sequence-parallel group")
    if _GROUPS is not None:
        if _GROUPS.size != sequence_parallel_size:
            raise ValueError(f"sequence parallelism is already set up with size {_GROUPS.size}; this process cannot "
                             f"switch to {sequence_parallel_size}")
        return
    rank = dist.get_rank()
    mine = None
    for start in range(0, world, sequence_parallel_size):
        # new_group is collective over the whole world: every rank creates every group, in the same order
        group = dist.new_group(list(range(start, start + sequence_parallel_size)))
        if start <= rank < start + sequence_parallel_size:
            mine = group
    _GROUPS = _SequenceGroups(sequence_parallel_size, mine, dist.group.WORLD)


def sequence_parallel_is_initialized() -> bool:
    return _GROUPS is not None


def release_sequence_parallel() -> None:
    """Forget the groups (after ``destroy_process_group``, or between tests); the next initialize creates new ones."""
    global _GROUPS
    _GROUPS = None


def _groups() -> _SequenceGroups:
    if _GROUPS is None:
        raise RuntimeError("no sequence-parallel group: Ulysses sequence parallelism is not set up in this process. "
                           "It is set up by UlyssesSPAttentionHF.register_with_transformers(...) (accelerate: "
                           "ParallelismConfig(sp_backend='deepspeed', sp_size=N)), by a config with "
                           "sequence_parallel_size > 1, or by hf_zero.comm.sequence_groups."
                           "initialize_sequence_parallel(N)")
    return _GROUPS


def get_sequence_parallel_group() -> dist.ProcessGroup:
    return _groups().group


def get_sequence_parallel_world_size() -> int:
    return _groups().size


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(_groups().group)


def get_sequence_data_parallel_group() -> dist.ProcessGroup:
    return _groups().data_group


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(_groups().data_group)


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(_groups().data_group)

