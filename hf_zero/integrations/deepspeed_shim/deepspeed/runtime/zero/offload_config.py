"""``deepspeed.runtime.zero.offload_config``: the enums of ``engine.offload_states``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "OffloadDeviceEnum": "hf_zero.zero.state_offload:OffloadDeviceEnum",
    "OffloadStateTypeEnum": "hf_zero.zero.state_offload:OffloadStateTypeEnum",
})
