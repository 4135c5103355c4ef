"""``deepspeed.runtime.sequence_parallel.parallel_state_sp`` is ``hf_zero.comm.sequence_groups``: the SP groups and
their getters (the mpu ``register_with_transformers`` returns)."""

from hf_zero.integrations.deepspeed_shim._forward import alias as _alias

_alias(__name__, "hf_zero.comm.sequence_groups")
