"""``deepspeed.launcher``: only ``runner.DEEPSPEED_ENVIRONMENT_NAME`` (accelerate launch imports it)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["runner"])
