"""``deepspeed.launcher``: ``runner`` (the launcher; accelerate launch imports its DEEPSPEED_ENVIRONMENT_NAME)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["runner"])
