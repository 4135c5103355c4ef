"""``deepspeed.utils.groups``: the process-group getters transformers and accelerate call."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"_get_sequence_parallel_group": "hf_zero.comm:get_sequence_parallel_group"})
