"""``deepspeed.ops.adagrad.cpu_adagrad``: where DeepSpeed defines DeepSpeedCPUAdagrad (scripts import it from here) ->
``hf_zero.ops.adagrad.CPUAdagrad``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"DeepSpeedCPUAdagrad": "hf_zero.ops.adagrad:CPUAdagrad"})
