"""``deepspeed.ops.adam.cpu_adam``: where DeepSpeed defines DeepSpeedCPUAdam (scripts import it from here) ->
``hf_zero.ops.adam.CPUAdam``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"DeepSpeedCPUAdam": "hf_zero.ops.adam:CPUAdam"})
