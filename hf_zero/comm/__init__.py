"""Thin layer over torch.distributed: start-up, the DeepSpeed-style functional API, and ZeRO's collectives.

Owns process groups, every collective hf_zero issues and the size of their buckets (buckets.py). Bottom layer:
imports torch only, no other hf_zero package (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from . import buffer_pool, comms_log, context, expert_groups, faults, sequence_groups, settings, shm_ring
from .device import accelerator_type, local_device
from .collectives import (all_gather_delivered, all_gather_packed, all_reduce_, all_to_all_single_, barrier,
                          reduce_scatter_filled, reduce_scatter_packed)
from .context import destroy_process_group
from .shm_collectives import give_packed, take_gather_buffer
from .sequence_groups import get_sequence_parallel_group
from .process_group import (ReduceOp, all_gather, all_reduce, bookkeeping_device, broadcast, default_backend, get_local_rank,
                            get_node_id, get_rank, get_world_size, init_distributed, is_initialized)

# the comms logger's straggler analysis all-reduces with the package's bounded collective (comms_log is a leaf)
comms_log.use_collectives(all_reduce=all_reduce_, bookkeeping_device=bookkeeping_device)

__all__ = ["buffer_pool", "comms_log", "context", "expert_groups", "faults", "sequence_groups", "settings", "shm_ring",
           "take_gather_buffer", "give_packed", "init_distributed", "is_initialized", "destroy_process_group",
           "get_rank", "get_world_size", "get_local_rank", "get_node_id", "get_sequence_parallel_group", "barrier",
           "default_backend", "all_reduce", "broadcast", "all_gather", "ReduceOp", "reduce_scatter_packed",
           "all_gather_packed", "reduce_scatter_filled", "all_gather_delivered", "all_reduce_", "all_to_all_single_",
           "accelerator_type", "local_device"]
