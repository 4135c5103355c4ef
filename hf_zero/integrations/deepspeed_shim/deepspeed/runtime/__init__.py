"""``deepspeed.runtime``: lr_schedules, zero, engine, utils, config, pipe, dataloader, sequence_parallel and
activation_checkpointing, each imported on first use."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["config", "dataloader", "engine", "lr_schedules", "pipe", "utils", "zero",
                                     "sequence_parallel", "activation_checkpointing"])
