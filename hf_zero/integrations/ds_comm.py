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
calls of torch.distributed with DeepSpeed's signatures. DeepSpeed's ``prof``/``log_name``/``debug`` arguments feed
its comms logger; hf_zero does not log collectives (``comms_logger`` in ``hf_zero/config/status.py``), so asking for
it (``prof=True``, ``configure(...)``, ``log_summary()``) warns once instead of being silently accepted.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch.distributed as dist

from hf_zero.comm import *  # noqa: F401,F403 -- deepspeed.comm is hf_zero.comm plus the functions below
from hf_zero.comm import __all__ as _comm_all
from hf_zero.comm import init_distributed as _init_distributed
from hf_zero.comm import is_initialized as _is_initialized

__all__ = list(_comm_all) + [
    "all_gather_into_tensor", "allgather_fn", "reduce_scatter_tensor", "reduce_scatter_fn", "reduce_scatter",
    "reduce", "inference_all_reduce", "all_to_all_single", "all_to_all", "gather", "scatter", "broadcast_object_list",
    "all_gather_object", "send", "recv", "isend", "irecv", "monitored_barrier", "new_group", "get_world_group",
    "get_global_rank", "get_all_ranks_from_group", "has_all_gather_into_tensor", "has_reduce_scatter_tensor",
    "configure", "log_summary", "reset_log", "has_comm_data", "get_comm_operation_count", "get_logged_comm_ops"]


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
# Every function takes DeepSpeed's trailing ``prof``/``log_name``/``debug``; ``prof=True`` asks the comms logger to
# time that call, which hf_zero does not do, so it warns (once) like ``configure``.

def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, prof=False,
                           log_name="all_gather_into_tensor", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                          log_name="reduce_scatter_tensor", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                   log_name="reduce_scatter", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce",
                         debug=None):
    """DeepSpeed's all-reduce for inference (a shared-memory kernel on CPU there): the same sums, in place."""
    _no_comms_logging_if(prof, log_name)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      prof=False, log_name="all_to_all_single", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, prof=False, log_name="all_to_all",
               debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False, log_name="gather", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False, log_name="scatter", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def broadcast_object_list(object_list, src, group=None, device=None, prof=False, log_name="broadcast_object_list",
                          debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather_object(object_list, obj, group=None, prof=False, log_name="all_gather_object", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.all_gather_object(object_list, obj, group=group)


def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, prof=False, log_name="monitored_barrier",
                      debug=None):
    _no_comms_logging_if(prof, log_name)
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def new_group(ranks):
    return dist.new_group(ranks)


def get_world_group():
    return dist.group.WORLD


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (the default group: the same number)."""
    return dist.get_global_rank(dist.group.WORLD if group is None else group, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


def has_all_gather_into_tensor() -> bool:
    return True  # torch >= 1.13 has it on every backend hf_zero runs


def has_reduce_scatter_tensor() -> bool:
    return True


# ---- DeepSpeed's comms logger: not done by hf_zero, so every request for it warns (once) ------------------------

_COMMS_LOGGING_WARNED = False


def _warn_no_comms_logging(asked_by: str) -> None:
    global _COMMS_LOGGING_WARNED
    if _COMMS_LOGGING_WARNED:
        return
    _COMMS_LOGGING_WARNED = True
    from hf_zero.config.status import STATUS, ConfigKeyIgnored

    warnings.warn(f"hf_zero: comms_logger is not implemented in hf_zero: {STATUS['comms_logger'].note} "
                  f"({asked_by} asked for it); nothing is recorded and log_summary() has nothing to report. Time "
                  f"collectives with torch.profiler instead", ConfigKeyIgnored, stacklevel=3)


def _no_comms_logging_if(prof: bool, log_name: str) -> None:
    if prof:
        _warn_no_comms_logging(f"deepspeed.comm.{log_name}(prof=True)")


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None) -> None:
    """DeepSpeed's comms-logger switch. Only switching it off (``enabled=False``) is what hf_zero already does;
    anything else warns once (``comms_logger`` in ``hf_zero/config/status.py``)."""
    from_config = getattr(getattr(deepspeed_config, "comms_config", None), "comms_logger_enabled", False)
    asks = (enabled is True or bool(prof_ops) or verbose is True or debug is True or prof_all is True
            or from_config is True)
    if asks:
        _warn_no_comms_logging("deepspeed.comm.configure")


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed prints (rank 0) and returns the logged collectives' statistics; hf_zero logs none, so it warns once
    and returns an empty dict when ``return_dict``. A barrier, as DeepSpeed's, keeps ranks in step."""
    _warn_no_comms_logging("deepspeed.comm.log_summary")
    if _is_initialized():
        dist.barrier()
    return {} if return_dict else None


def reset_log() -> None:
    """Nothing is logged, so nothing to clear."""


def has_comm_data() -> bool:
    return False


def get_comm_operation_count() -> int:
    return 0


def get_logged_comm_ops() -> list[str]:
    return []
