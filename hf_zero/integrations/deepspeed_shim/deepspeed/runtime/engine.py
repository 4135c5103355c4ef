"""``deepspeed.runtime.engine.DeepSpeedEngine`` is ``hf_zero.runtime.engine.HfZeroEngine``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"DeepSpeedEngine": "hf_zero.runtime.engine:HfZeroEngine"})
