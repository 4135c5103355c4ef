"""``deepspeed.utils.groups``' data-parallel and tensor-(model-)parallel getters, over the run's mesh.

DeepSpeed sets these groups at ``deepspeed.initialize`` (its AutoTP mesh: ``tensor_parallel.autotp_size``, or an
``mpu``); its AutoTP guide tells scripts to shard their own data with ``groups.get_tensor_model_parallel_group()``.
hf_zero answers from the mesh of the last initialized run (hf_zero/parallel/current.py): ``dp`` and ``tp``.

Two families, as DeepSpeed has them: the public getters assert the group exists (DeepSpeed: "... group is not
initialized"; an AssertionError here too), the underscore ones fall back to the whole world (data parallel) or to 1
(model parallel) when no run set one up.
"""

from __future__ import annotations

import torch.distributed as dist

from hf_zero.parallel.current import run_group

__all__ = ["get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
           "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
           "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_src_rank",
           "_get_data_parallel_group", "_get_data_parallel_rank", "_get_data_parallel_world_size",
           "_get_model_parallel_world_size"]


def _required(dim: str, what: str) -> dist.ProcessGroup:
    group = run_group(dim)
    if group is None:
        raise AssertionError(f"{what} group is not initialized (hf_zero: it exists once deepspeed.initialize has "
                             f"built a run{' with tensor parallelism' if dim == 'tp' else ''})")
    return group


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    """This rank's tensor-parallel group (of one rank in a run without tensor parallelism, where DeepSpeed has
    none); before any run, DeepSpeed's assertion."""
    return _required("tp", "intra_layer_model parallel")


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(get_tensor_model_parallel_group())


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of this tensor-parallel group's first member (the rank that broadcasts a batch to it)."""
    return dist.get_global_rank(get_tensor_model_parallel_group(), 0)


def get_model_parallel_group() -> dist.ProcessGroup:
    return get_tensor_model_parallel_group()


def get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    return get_tensor_model_parallel_rank()


def get_data_parallel_group() -> dist.ProcessGroup:
    return _required("dp", "data parallel")


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(get_data_parallel_group())


def _get_data_parallel_group() -> dist.ProcessGroup:
    """The run's data-parallel group, else the whole world (DeepSpeed's fallback)."""
    if not dist.is_initialized():
        raise AssertionError("dist is not initialized")
    group = run_group("dp")
    return group if group is not None else dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size(_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    return dist.get_rank(_get_data_parallel_group())


def _get_model_parallel_world_size() -> int:
    group = run_group("tp")
    return dist.get_world_size(group) if group is not None else 1
