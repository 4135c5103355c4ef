"""``deepspeed.ops.adagrad``: DeepSpeedCPUAdagrad -> ``hf_zero.ops.adagrad.CPUAdagrad`` (compiled CPU kernel)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"DeepSpeedCPUAdagrad": "hf_zero.ops.adagrad:CPUAdagrad"}, submodules=["cpu_adagrad"])
