"""DeepSpeed-format configuration: strict typed schema, "auto" resolution, batch arithmetic, startup table.

    cfg = load_config("ds_config.json", world_size=4, auto_values={"optimizer.params.lr": 5e-5})
    cfg.zero.stage, cfg.train_micro_batch_size_per_gpu, cfg.compute_dtype, cfg.raw  # raw: what engine.config returns

Owns every reading of the DeepSpeed schema: :mod:`.status` says what hf_zero does with each key, and
:mod:`.policies` translates it, once, into the frozen policies ``zero/`` and ``offload/`` take. Bottom layer:
imports no other hf_zero package (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from .auto import AUTO_HINTS
from .errors import ConfigError
from .hf_zero_config import HfZeroConfig
from .loader import load_config, read_config
from .policies import (CPUOffloadPolicy, NVMeOffloadPolicy, OffloadPolicy, PrecisionPolicy, Stage3Policy, ZeroPolicy,
                       loss_scale_policy, param_offload_policy, precision_policy, zero_policy)
from .optim import OPTIMIZER_TYPES, SCHEDULER_TYPES, OptimizerConfig, SchedulerConfig
from .schema import AUTO, doc, known_keys
from .sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    MonitorConfig,
    OffloadConfig,
    ParamOffloadConfig,
    WandbConfig,
    ZeroConfig,
)
from .table import format_config_table

__all__ = [
    "AUTO",
    "AUTO_HINTS",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "CPUOffloadPolicy",
    "CheckpointConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "HfZeroConfig",
    "MonitorConfig",
    "NVMeOffloadPolicy",
    "OPTIMIZER_TYPES",
    "OffloadConfig",
    "OffloadPolicy",
    "OptimizerConfig",
    "ParamOffloadConfig",
    "PrecisionPolicy",
    "SCHEDULER_TYPES",
    "SchedulerConfig",
    "Stage3Policy",
    "WandbConfig",
    "ZeroConfig",
    "ZeroPolicy",
    "doc",
    "format_config_table",
    "known_keys",
    "load_config",
    "loss_scale_policy",
    "param_offload_policy",
    "precision_policy",
    "read_config",
    "zero_policy",
]
