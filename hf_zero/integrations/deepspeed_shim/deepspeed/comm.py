"""``deepspeed.comm`` is ``hf_zero.integrations.ds_comm``: ``hf_zero.comm`` (init_distributed, is_initialized,
get_rank, get_world_size, barrier, ...) plus the fix that lets accelerate see every rank on a CPU-only machine."""

from hf_zero.integrations.deepspeed_shim._forward import alias as _alias

_alias(__name__, "hf_zero.integrations.ds_comm")
