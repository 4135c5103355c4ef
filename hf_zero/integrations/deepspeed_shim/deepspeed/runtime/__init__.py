"""``deepspeed.runtime``: lr_schedules, zero, engine, utils and sequence_parallel, each imported on first use."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["engine", "lr_schedules", "utils", "zero", "sequence_parallel"])
