"""``deepspeed.comm`` as hf_zero answers it: :mod:`hf_zero.comm`, plus the one fix accelerate needs on CPU.

accelerate starts DeepSpeed's process group in ``PartialState.__init__`` (``accelerate/state.py``, the
``ACCELERATE_USE_DEEPSPEED`` branch)::

    from deepspeed import comm as dist
    if not dist.is_initialized():
        dist.init_distributed(dist_backend=self.backend, auto_mpi_discovery=False, **kwargs)
    ...
    if self.backend is None:                      # no GPU backend was found: "no distributed training"
        self.num_processes, self.process_index = 1, 0

On a machine without a GPU ``self.backend`` is None at that point (accelerate picks ``gloo`` only for
``cpu=True``, and ``cpu=True`` makes it drop DeepSpeed), so every rank of a 2-process ``torchrun`` /
``accelerate launch`` believes it is alone: the Trainer fills ``train_batch_size`` for a world of 1 and
dataloaders are not sharded. That is what real DeepSpeed does on CPU (``ds_api_surface.md`` section 5).

hf_zero closes that gap here, without touching accelerate's code: when accelerate asks whether the group is
initialized, or has just had it initialized, *while that exact ``PartialState.__init__`` is running* (its shared
state holds ``backend=None`` and no ``num_processes`` yet) and the process group exists, the backend the group was
really started with (``gloo``) is recorded as accelerate's backend. accelerate then takes its own distributed
branch: ``num_processes = world_size``, ``process_index = rank``. Any other caller sees plain :mod:`hf_zero.comm`.

The rest of DeepSpeed's functional API that training scripts call (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``reduce``, the object collectives, point-to-point, ``new_group``, ...) is below: thin
calls of torch.distributed with DeepSpeed's signatures. Their ``prof``/``log_name`` arguments feed the comms logger
(:mod:`hf_zero.comm.comms_log`, which hf_zero's own collectives record into as well); ``configure``, ``log_summary``,
``reset_log`` and the counters below are DeepSpeed's calls on it.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from hf_zero.comm import *  # noqa: F401,F403 -- deepspeed.comm is hf_zero.comm plus the functions below
from hf_zero.comm import __all__ as _comm_all
from hf_zero.comm import barrier as _barrier
from hf_zero.comm.collectives import DoneWork
from hf_zero.comm import comms_log as _comms_log
from hf_zero.comm import init_distributed as _init_distributed
from hf_zero.comm import is_initialized as _is_initialized

__all__ = list(_comm_all) + [
    "all_gather_into_tensor", "allgather_fn", "reduce_scatter_tensor", "reduce_scatter_fn", "reduce_scatter",
    "reduce", "inference_all_reduce", "all_to_all_single", "all_to_all", "gather", "scatter", "broadcast_object_list",
    "all_gather_object", "send", "recv", "isend", "irecv", "monitored_barrier", "new_group", "get_world_group",
    "get_global_rank", "get_all_ranks_from_group", "has_all_gather_into_tensor", "has_reduce_scatter_tensor",
    "configure", "log_summary", "reset_log", "has_comm_data", "get_comm_operation_count", "get_logged_comm_ops",
    "comms_logger", "initialize_mesh_device"]


def is_initialized() -> bool:
    initialized = _is_initialized()
    if initialized:
        _adopt_backend_into_accelerate_state()
    return initialized


def init_distributed(*args, **kwargs) -> None:
    _init_distributed(*args, **kwargs)
    _adopt_backend_into_accelerate_state()


def _adopt_backend_into_accelerate_state() -> bool:
    """Record the process group's backend as accelerate's, if accelerate is mid-``PartialState.__init__`` with
    DeepSpeed requested and no backend found. Returns whether it did."""
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return False
    shared = accelerate_state.PartialState._shared_state
    starting = (bool(shared) and "num_processes" not in shared and "backend" in shared
                and shared["backend"] is None and not shared.get("_cpu", False))
    if not starting or not _is_initialized():
        return False
    shared["backend"] = str(dist.get_backend())
    return True


# ---- the rest of DeepSpeed's functional API: torch.distributed with DeepSpeed's argument names -------------------
# Every function takes DeepSpeed's trailing ``prof``/``log_name``/``debug``; with the comms logger on, ``prof=True``
# (or ``prof_all``, or ``log_name`` in ``prof_ops``) has the call timed and recorded. ``timed_op``'s argument names
# the tensor(s) this rank sends: the message size.

@_comms_log.timed_op("tensor")
def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, prof=False,
                           log_name="all_gather_into_tensor", debug=None):
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


@_comms_log.timed_op("tensor")
def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                          log_name="reduce_scatter_tensor", debug=None):
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof)


@_comms_log.timed_op("input_list")
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                   log_name="reduce_scatter", debug=None):
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


@_comms_log.timed_op("tensor")
def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce", debug=None):
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


@_comms_log.timed_op("tensor")
def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce",
                         debug=None):
    """DeepSpeed's all-reduce for inference (a shared-memory kernel on CPU there): the same sums, in place."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@_comms_log.timed_op("tensor")
def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      prof=False, log_name="all_to_all_single", debug=None):
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


@_comms_log.timed_op("input_tensor_list")
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, prof=False, log_name="all_to_all",
               debug=None):
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@_comms_log.timed_op("tensor")
def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False, log_name="gather", debug=None):
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


@_comms_log.timed_op("tensor")
def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False, log_name="scatter", debug=None):
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


@_comms_log.timed_op()
def broadcast_object_list(object_list, src, group=None, device=None, prof=False, log_name="broadcast_object_list",
                          debug=None):
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


@_comms_log.timed_op()
def all_gather_object(object_list, obj, group=None, prof=False, log_name="all_gather_object", debug=None):
    return dist.all_gather_object(object_list, obj, group=group)


@_comms_log.timed_op("tensor")
def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    return dist.send(tensor, dst=dst, group=group, tag=tag)


@_comms_log.timed_op("tensor")
def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    return dist.recv(tensor, src=src, group=group, tag=tag)


@_comms_log.timed_op("tensor")
def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


@_comms_log.timed_op("tensor")
def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None):
    """DeepSpeed's signature over hf_zero's bounded barrier (``deepspeed.comm.barrier()`` is what scripts call;
    ``device_ids`` only selects NCCL's device). With ``async_op`` the returned work is already complete."""
    _barrier(group, what="deepspeed.comm.barrier()", log_name=log_name)
    return DoneWork() if async_op else None


@_comms_log.timed_op()
def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, prof=False, log_name="monitored_barrier",
                      debug=None):
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def new_group(ranks):
    return dist.new_group(ranks)


def get_world_group():
    return dist.group.WORLD


def initialize_mesh_device(mesh_shape, mesh_dim_names):
    """DeepSpeed's: a torch DeviceMesh of ``mesh_shape`` over the initialized world, on this process's accelerator
    (CPU with gloo). Refused before the process group exists, as DeepSpeed asserts."""
    if not is_initialized():
        raise RuntimeError("deepspeed.comm.initialize_mesh_device: the process group is not initialized; call "
                           "deepspeed.init_distributed() first")
    from torch.distributed.device_mesh import init_device_mesh

    from hf_zero.comm.device import accelerator_type

    return init_device_mesh(accelerator_type(), tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (the default group: the same number)."""
    return dist.get_global_rank(dist.group.WORLD if group is None else group, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


def has_all_gather_into_tensor() -> bool:
    return True  # torch >= 1.13 has it on every backend hf_zero runs


def has_reduce_scatter_tensor() -> bool:
    return True


# ---- DeepSpeed's comms logger (hf_zero/comm/comms_log.py) --------------------------------------------------------

comms_logger = _comms_log.logger  # DeepSpeed's module-level instance: scripts read its comms_dict

def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None) -> None:
    """DeepSpeed's comms-logger switches: first the ``comms_logger`` section of ``deepspeed_config`` when that
    section is enabled (a ``deepspeed.runtime.config.DeepSpeedConfig``, or an ``HfZeroConfig``), then every
    argument that is not None."""
    if deepspeed_config is not None:
        comms_config = getattr(deepspeed_config, "comms_config", None)
        if comms_config is not None:
            if comms_config.comms_logger_enabled:
                _comms_log.logger.configure(comms_config)
        elif hasattr(deepspeed_config, "comms_logger"):
            _comms_log.configure_from(deepspeed_config.comms_logger)
        else:
            raise TypeError(f"deepspeed.comm.configure(deepspeed_config=...) takes a DeepSpeedConfig "
                            f"(deepspeed.runtime.config) or an hf_zero HfZeroConfig, got "
                            f"{type(deepspeed_config).__name__}")
    _comms_log.configure(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug)


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """Print the logged collectives' table on rank 0 (every op, every message size: count, total and average
    latency, average algorithmic and bus bandwidth) and, with ``return_dict``, return it on every rank (structure:
    ``CommsLogger.log_all``). Collective: the barriers before and after (logged as ``log_summary_barrier``, as
    DeepSpeed's are) keep ranks in step, and ``show_straggler`` all-reduces the latencies."""
    initialized = _is_initialized()
    if initialized:
        _barrier(what="the barrier of log_summary", log_name="log_summary_barrier")
    rank = dist.get_rank() if initialized else 0
    result = _comms_log.logger.log_all(print_log=rank == 0, show_straggler=show_straggler, return_dict=return_dict)
    if initialized:
        _barrier(what="the barrier of log_summary", log_name="log_summary_barrier")
    return result


def reset_log() -> None:
    """Forget every logged collective (e.g. to report each epoch on its own)."""
    _comms_log.logger.reset_data()


def has_comm_data() -> bool:
    return _comms_log.logger.has_data()


def get_comm_operation_count() -> int:
    """How many collectives are logged, over every op and message size."""
    return _comms_log.logger.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    return _comms_log.logger.get_operation_names()
