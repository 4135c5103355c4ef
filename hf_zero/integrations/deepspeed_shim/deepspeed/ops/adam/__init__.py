"""``deepspeed.ops.adam``: DeepSpeedCPUAdam -> ``hf_zero.ops.adam.CPUAdam``, FusedAdam -> the same-named class."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "DeepSpeedCPUAdam": "hf_zero.ops.adam:CPUAdam",
    "FusedAdam": "hf_zero.ops.adam:FusedAdam",
}, submodules=["cpu_adam", "fused_adam"])
