"""``deepspeed.runtime``: lr_schedules, zero, engine and utils, each imported on first use."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["engine", "lr_schedules", "utils", "zero"])
