"""``deepspeed.runtime.lr_schedules`` is ``hf_zero.runtime.lr_schedules`` (VALID_LR_SCHEDULES, WarmupLR, ...)."""

from hf_zero.integrations.deepspeed_shim._forward import alias as _alias

_alias(__name__, "hf_zero.runtime.lr_schedules")
