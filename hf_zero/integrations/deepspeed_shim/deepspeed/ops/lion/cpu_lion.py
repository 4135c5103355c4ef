"""``deepspeed.ops.lion.cpu_lion``: where DeepSpeed defines DeepSpeedCPULion (scripts import it from here) ->
``hf_zero.ops.lion.CPULion``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"DeepSpeedCPULion": "hf_zero.ops.lion:CPULion"})
