"""``deepspeed.ops.lion``: DeepSpeedCPULion -> ``hf_zero.ops.lion.CPULion`` (compiled CPU kernel)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"DeepSpeedCPULion": "hf_zero.ops.lion:CPULion"}, submodules=["cpu_lion"])
