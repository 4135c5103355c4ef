"""``deepspeed.runtime``: lr_schedules, zero and engine, each imported on first use."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["engine", "lr_schedules", "zero"])
