"""ZeRO stage 3: parameters partitioned across ranks, gathered per module for forward and backward.

Where a shard's bytes live and who may free them: ``param.py`` (:class:`ShardedParam`: its ``storage``, resident or
swapped, moved only by ``to_swapped``/``to_resident``; its full copy freed only when the last hold --
``acquire/release(HoldReason)`` -- is gone); ``runtime.py`` takes and drops those holds at the training-state
transitions of ``states.py``.

=============== =====================================================================
param.py        one partitioned parameter (:class:`ShardedParam`) and its state enum
storage.py      where a shard's bytes live (resident / swapped) and who may free them
gather.py       packed all-gathers of parameters, live-memory accounting
divergence.py   making a diverged gather an error that names modules and ranks
hooks.py        forward/backward hook plumbing (public PyTorch APIs only)
states.py       each module call's training state (forward / recompute / backward) and its transitions
prefetch.py     the recorded gather order: prefetch and reuse decisions
reduce.py       bucketed gradient reduce-scatter into the grad storage
runtime.py      :class:`Stage3Runtime`, what the engine drives
consolidate.py  full 16-bit state dict on rank 0, streamed module by module
offload_view.py DeepSpeed's ``optimizer.parameter_offload`` (what TRL's generation reaches into)
=============== =====================================================================
"""

from .consolidate import consolidated_state_dict
from .divergence import DivergenceError
from .param import ParamState, ShardedParam, is_sharded, sharded_param_of
from .runtime import Stage3Runtime

__all__ = ["Stage3Runtime", "ShardedParam", "ParamState", "DivergenceError", "consolidated_state_dict",
           "sharded_param_of", "is_sharded"]
