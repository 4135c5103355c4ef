"""``deepspeed``, as answered by hf_zero (see ``hf_zero/integrations/deepspeed_shim/__init__.py``).

Not DeepSpeed: each name forwards to hf_zero. ``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1`` turns this off.
"""

from hf_zero.integrations.deepspeed_shim._finder import shim_version as _shim_version
from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

__version__ = _shim_version()
version = __version__  # DeepSpeed's deepspeed.version (git_version_info.version)
# DeepSpeed's version parts and build info, which scripts (and its own tests) read from the package
__version_major__, __version_minor__, __version_patch__ = (
    [int(p) for p in __version__.split("+")[0].split(".")[:3] if p.isdigit()] + [0, 0, 0])[:3]

_forward(__name__, {
    "initialize": "hf_zero.integrations.compat:initialize",  # hf_zero's, logging DeepSpeed's info line
    "add_config_arguments": "hf_zero.runtime.arguments:add_config_arguments",
    "init_distributed": "hf_zero.comm:init_distributed",
    "DeepSpeedEngine": "hf_zero.runtime.engine:HfZeroEngine",
    "init_inference": "hf_zero.runtime.inference:init_inference",
    "InferenceEngine": "hf_zero.runtime.inference:InferenceEngine",
    "tp_model_init": "hf_zero.tensor_parallel:tp_model_init",
    "zero": "deepspeed.runtime.zero",  # as in DeepSpeed, deepspeed.zero is deepspeed.runtime.zero
    "PipelineModule": "hf_zero.pipeline:PipelineModule",
    "PipelineEngine": "hf_zero.runtime.pipe_engine:PipelineEngine",
    "DeepSpeedConfig": "hf_zero.integrations.ds_config:DeepSpeedConfig",
    # what a config hf_zero refuses raises (a ValueError naming the key), caught under DeepSpeed's name
    "DeepSpeedConfigError": "hf_zero.config.errors:ConfigError",
    "__git_hash__": "hf_zero.integrations.ds_version_info:git_hash",
    "__git_branch__": "hf_zero.integrations.ds_version_info:git_branch",
    "get_accelerator": "hf_zero.comm.accelerator:get_accelerator",
    # as in DeepSpeed, deepspeed.checkpointing is deepspeed.runtime.activation_checkpointing.checkpointing
    "checkpointing": "deepspeed.runtime.activation_checkpointing.checkpointing",
    # what DeepSpeed's package also exports at its top (inference scripts: ``with deepspeed.OnDevice(...)``)
    "OnDevice": "hf_zero.integrations.ds_utils:OnDevice",
    "log_dist": "hf_zero.integrations.ds_utils:log_dist",
    "logger": "hf_zero.integrations.compat:logger",
    "DeepSpeedDataLoader": "hf_zero.runtime.dataloader:DeepSpeedDataLoader",
    "DeepSpeedInferenceConfig": "hf_zero.runtime.inference_config:DeepSpeedInferenceConfig",
}, submodules=["accelerator", "checkpoint", "comm", "compression", "elasticity", "inference", "launcher", "moe", "monitor",
                "ops", "pipe", "profiling", "runtime", "sequence", "utils"])
