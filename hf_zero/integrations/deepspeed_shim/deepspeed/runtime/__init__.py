"""``deepspeed.runtime``: lr_schedules, zero, engine, utils, config, pipe, dataloader, sequence_parallel,
activation_checkpointing, fp16 (its loss_scaler) and progressive_layer_drop, each imported on first use."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["config", "dataloader", "engine", "fp16", "lr_schedules", "pipe", "utils", "zero",
                                     "sequence_parallel", "activation_checkpointing", "progressive_layer_drop"])
