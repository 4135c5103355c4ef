"""``HfZeroConfig``: the whole DeepSpeed-format config as one frozen, typed object.

Top-level JSON keys are the fields below (``zero_optimization`` is read into ``zero``; ``bfloat16`` is the legacy
name of ``bf16``). Sections DeepSpeed has but hf_zero does not run yet are accepted and kept as plain mappings or
typed sections. What hf_zero does with each key -- honoured, no effect by design, not implemented, refused -- is
one table in :mod:`hf_zero.config.status`; :func:`not_implemented` names the keys a config actually sets that
hf_zero does not run, so the startup table can say so instead of silently ignoring them. The last four fields are
filled by :func:`load_config`, never read from JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .errors import ConfigError
from .optim import OptimizerConfig, SchedulerConfig
from .schema import Auto, spec
from .sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    CurriculumLearningConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    HybridEngineConfig,
    MonitorConfig,
    ProgressiveLayerDropConfig,
    TimersConfig,
    TorchAutocastConfig,
    WandbConfig,
    ZeroConfig,
)

if TYPE_CHECKING:
    import torch

__all__ = ["HfZeroConfig", "log_level_number", "not_implemented"]

_RAW_SECTION = "Accepted and kept as given; hf_zero does not run it yet (listed in the startup table)."


@dataclass(frozen=True, kw_only=True)
class HfZeroConfig:
    """A validated DeepSpeed config. Build it with :func:`hf_zero.config.load_config`."""

    _unsupported_keys: ClassVar[dict[str, str]] = {
        "sparse_attention": "Sparse attention kernels",
        "eigenvalue": "Eigenvalue-based layer-wise learning rates",
        "quantize_training": "MoQ quantize-aware training (use compression_training)",
        "weight_quantization": "Post-training weight quantization for inference",
        "nebula": "Nebula checkpointing service",
        "compile": "DeepCompile",
        "disable_allgather": "Legacy allgather switch",
        "graph_harvesting": "Graph harvesting",
    }

    # Batch: after load_config all three are ints and train_batch_size == micro * accumulation * world_size.
    train_batch_size: int | None | Auto = spec(
        None, auto=True, help="Global batch per optimizer step: micro batch * accumulation steps * world size.")
    train_micro_batch_size_per_gpu: int | None | Auto = spec(
        None, auto=True, help="Samples per rank per forward/backward.")
    gradient_accumulation_steps: int | None | Auto = spec(
        None, auto=True, help="Micro batches accumulated before each optimizer step.")
    managed_gradient_accumulation: bool = spec(
        True, help="false: the caller's engine.step() is the accumulation boundary (DeepSpeed's unmanaged mode): "
                   "backward passes sum gradients until step() reduces and applies them, whatever their number; "
                   "backward still divides by gradient_accumulation_steps (scale_wrt_gas).")
    # 1.0 when absent, as DeepSpeed (GRADIENT_CLIPPING_DEFAULT, runtime/constants.py): a DeepSpeed config without
    # the key clips there, so it must clip here too (load_config logs it once).
    gradient_clipping: float | Auto = spec(
        1.0, auto=True, help="Clip the global gradient norm to this; 0 is off. Absent: 1.0, as in DeepSpeed.")
    steps_per_print: int | None = spec(10, help="Log progress every this many steps; null or Infinity never.")
    wall_clock_breakdown: bool = spec(False, help="Time forward, backward and step, and log the breakdown.")
    memory_breakdown: bool = spec(False, help="Log accelerator memory at each stage of a step.")
    disable_python_gc: bool = spec(
        False, help="Turn Python's automatic cyclic garbage collector off while the engine lives (its pauses land "
                    "at arbitrary points of a step); engine.collect_python_gc() collects where the script chooses.")
    log_level: str | None = spec(
        None, help="The level of hf_zero's logger (DeepSpeed's logger under `import deepspeed`): debug, info, "
                   "warning, error or critical, any case; set at initialize(), before the config table. None: "
                   "leave it as it is.")
    dump_state: bool = spec(False, help="Print the engine state after initialisation.")
    prescale_gradients: bool = spec(False, help="Divide gradients by the world size before reducing them.")
    gradient_allreduce_op: str = spec(
        "mean", help="'mean' averages the data-parallel gradients, 'sum' adds them (ZeRO 0-2; DeepSpeed 0.19.8).")
    gradient_predivide_factor: float = spec(
        1.0, help="Divide gradients by this before the reduction and by world_size/this after.")
    sparse_gradients: bool = spec(False, help="Reduce embedding gradients as sparse tensors.")
    dataloader_drop_last: bool = spec(
        False, help="Drop the last, partial batch of the loader initialize(training_data=...) returns.")
    zero_allow_untested_optimizer: bool = spec(
        False, help="Allow a client optimizer hf_zero has not been tested with under ZeRO.")
    comms_timeout_s: float | None = spec(
        None, help="hf_zero: seconds any hf_zero collective may wait before the job fails on every rank with an "
                   "error naming the rank that stopped answering or died (docs/reliability.md). Also the timeout of "
                   "the process group hf_zero creates. Default: DEEPSPEED_TIMEOUT (minutes) if set, else 300.")
    comms_divergence_check: bool = spec(
        True, help="hf_zero: before every collective, check (one 5-integer all-gather) that all ranks issue the "
                   "same one, so a rank running other modules fails with their names instead of hanging.")
    use_data_before_expert_parallelism: bool = spec(
        False, help="MoE expert parallelism's rank layout, as DeepSpeed's: false (E + D), expert-parallel groups of "
                    "consecutive ranks; true (D + E), expert-data-parallel groups of consecutive ranks and "
                    "expert-parallel groups strided by world_size / ep_size.")
    zero_force_ds_cpu_optimizer: bool = spec(
        True, help="With optimizer offload, require hf_zero's CPU optimizer rather than a client one.")
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = spec(
        None, help="Dtype gradients are reduced in; default: the training dtype.")
    data_parallel_size: int | None = spec(
        None, help="Data-parallel ranks (DeepSpeed reads it with sequence_parallel_size); must be the world size.")
    sequence_parallel_size: int | None = spec(
        None, help="Ulysses sequence parallelism: ranks per sequence-parallel group (hf_zero.sequence_parallel); "
                   "the batch sizes count world / sequence_parallel_size replicas. Must agree with an mpu's.")
    seq_parallel_communication_data_type: Literal["fp32", "fp16", "bf16"] | None = spec(
        None, help="With sequence_parallel_size > 1, DeepSpeed's communication_data_type for the gradient reduction; "
                   "without sequence parallelism it changes nothing (as in DeepSpeed).")
    torch_autocast: TorchAutocastConfig = spec(default_factory=TorchAutocastConfig,
                                               help="torch.autocast forward with fp32 parameters.")
    fp16: FP16Config = spec(default_factory=FP16Config, help="float16 mixed precision with loss scaling.")
    bf16: BF16Config = spec(default_factory=BF16Config, aliases=("bfloat16",), help="bfloat16 mixed precision.")
    amp: Mapping[str, Any] | None = spec(None, help="NVIDIA apex AMP. " + _RAW_SECTION)
    optimizer: OptimizerConfig | None = spec(None, help="The optimizer to build when initialize() gets none.")
    scheduler: SchedulerConfig | None = spec(
        None, help="The learning-rate schedule to build when initialize() gets none.")
    zero: ZeroConfig = spec(default_factory=ZeroConfig, key="zero_optimization", help="ZeRO partitioning and offload.")
    aio: AioConfig = spec(default_factory=AioConfig, help="Asynchronous I/O for NVMe offload.")
    activation_checkpointing: ActivationCheckpointingConfig = spec(
        default_factory=ActivationCheckpointingConfig, help="DeepSpeed activation-checkpointing API options.")
    flops_profiler: FlopsProfilerConfig = spec(default_factory=FlopsProfilerConfig, help="FLOPs profiler.")
    tensorboard: MonitorConfig = spec(default_factory=MonitorConfig, help="TensorBoard metrics.")
    csv_monitor: MonitorConfig = spec(default_factory=MonitorConfig, help="CSV metrics.")
    wandb: WandbConfig = spec(default_factory=WandbConfig, help="Weights & Biases metrics.")
    comet: CometConfig = spec(default_factory=CometConfig, help="Comet metrics.")
    comms_logger: CommsLoggerConfig = spec(default_factory=CommsLoggerConfig, help="Log collectives.")
    timers: TimersConfig = spec(default_factory=TimersConfig, help="The throughput timer (engine.tput_timer).")
    hybrid_engine: HybridEngineConfig = spec(default_factory=HybridEngineConfig,
                                             help="RLHF: the training engine generates (engine.generate).")
    checkpoint: CheckpointConfig = spec(default_factory=CheckpointConfig, help="Checkpoint tagging and layout.")
    data_types: DataTypesConfig = spec(default_factory=DataTypesConfig, help="Dtypes of internal buffers.")
    pipeline: Mapping[str, Any] | None = spec(None, help="Pipeline-parallel engine options. " + _RAW_SECTION)
    compression_training: Mapping[str, Any] | None = spec(
        None, help="Quantization / pruning / distillation during training; parsed by hf_zero.compression.")
    tensor_parallel: Mapping[str, Any] | None = spec(
        None, help="AutoTP tensor parallelism (autotp_size, ...); parsed by the tensor_parallel package.")
    elasticity: Mapping[str, Any] | None = spec(
        None, help="Elastic batch sizes: when enabled, the batch keys come from DeepSpeed's elastic plan for the world "
                   "size; parsed by hf_zero.config.elasticity.")
    autotuning: Mapping[str, Any] | None = spec(None, help="DeepSpeed autotuner. " + _RAW_SECTION)
    expert_parallel: Mapping[str, Any] | None = spec(
        None, help="DeepSpeed's AutoEP (Hugging Face MoE blocks converted to expert-parallel layers). " + _RAW_SECTION)
    data_efficiency: Mapping[str, Any] | None = spec(None, help="Data sampling and routing. " + _RAW_SECTION)
    progressive_layer_drop: ProgressiveLayerDropConfig = spec(
        default_factory=ProgressiveLayerDropConfig,
        help="DeepSpeed's progressive layer dropping: the model's forward gets progressive_layer_drop= and pld_theta=.")
    curriculum_learning: CurriculumLearningConfig = spec(
        default_factory=CurriculumLearningConfig,
        help="DeepSpeed's legacy curriculum (Megatron-DeepSpeed's): the model's forward gets curriculum_seqlen=.")

    # Filled by load_config.
    world_size: int = spec(1, json=False, help="Data-parallel world size the batch arithmetic was done for.")
    raw: Mapping[str, Any] = spec(
        default_factory=dict, json=False,
        help="The resolved JSON dict (user's keys, 'auto' filled, batch keys and zero_optimization.stage present); "
             "what engine.config returns. Treat as read-only.")
    not_implemented: tuple[str, ...] = spec(
        (), json=False, help="Keys this config switches on that hf_zero accepts but does not run yet.")
    sources: Mapping[str, str] = spec(
        default_factory=dict, json=False,
        help="Dotted key -> where its value came from: 'auto' (auto_values), 'auto, derived', 'derived' (batch "
             "arithmetic) or 'default' (a batch key nothing determined).")

    def __post_init__(self) -> None:
        if self.sequence_parallel_size is not None and self.sequence_parallel_size < 1:
            raise ConfigError("sequence_parallel_size", f"{self.sequence_parallel_size}: must be >= 1")
        if self.fp16.enabled is True and self.bf16.enabled is True:
            raise ConfigError("bf16.enabled",
                              "true together with fp16.enabled true; enable at most one of fp16 and bf16")
        self._check_param_dtype()
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            value = getattr(self, key)
            if isinstance(value, int) and value < 1:
                raise ConfigError(key, f"must be a positive integer, got {value}")
        if isinstance(self.gradient_clipping, float) and self.gradient_clipping < 0:
            raise ConfigError("gradient_clipping", f"must be >= 0 (0 is off), got {self.gradient_clipping}")
        op = self.gradient_allreduce_op.lower() if isinstance(self.gradient_allreduce_op, str) else None
        if op not in ("mean", "sum"):
            raise ConfigError("gradient_allreduce_op", f"{self.gradient_allreduce_op!r} is not supported; use 'mean' "
                                                       "or 'sum'")
        if op == "sum" and self.zero.stage == 3:
            raise ConfigError("gradient_allreduce_op", "'sum' is not supported with ZeRO stage 3 (DeepSpeed refuses "
                                                       "it too); use 'mean'")
        if op == "sum" and self.zero.zenflow is not None:
            raise ConfigError("gradient_allreduce_op", "'sum' is not supported with zero_optimization.zenflow "
                                                       "(DeepSpeed refuses it too); use 'mean'")
        if not self.managed_gradient_accumulation and self.zero.zenflow is not None:
            raise ConfigError("managed_gradient_accumulation", "false is not supported with zero_optimization.zenflow, "
                                                               "whose update and select boundaries count micro-steps; "
                                                               "remove one of the two")
        log_level_number(self.log_level)  # refuses an unknown level, naming the key
        if not self.zero.compute_grad_norm:
            if not isinstance(self.gradient_clipping, Auto) and self.gradient_clipping > 0:
                raise ConfigError("zero_optimization.compute_grad_norm",
                                  f"false needs gradient_clipping 0: clipping at {self.gradient_clipping:g} needs the "
                                  f"norm (DeepSpeed refuses the pair too; gradient_clipping is 1.0 when absent)")
            if self.zero.zenflow is not None:
                raise ConfigError("zero_optimization.compute_grad_norm", "false is not supported with "
                                                                         "zero_optimization.zenflow (DeepSpeed "
                                                                         "refuses it too)")
        if self.gradient_predivide_factor <= 0:
            raise ConfigError("gradient_predivide_factor", f"must be > 0, got {self.gradient_predivide_factor}")
        if self.steps_per_print is not None and self.steps_per_print < 1:
            raise ConfigError("steps_per_print", f"must be >= 1 (or null for never), got {self.steps_per_print}")

    def _check_param_dtype(self) -> None:
        """``data_types.param_dtype`` only restates the precision mode (DeepSpeed asserts the same at initialize)."""
        wanted = self.data_types.param_dtype
        if wanted is None or isinstance(self.bf16.enabled, Auto) or isinstance(self.fp16.enabled, Auto):
            return
        mode = "bf16" if self.bf16.enabled is True else "fp16" if self.fp16.enabled is True else "fp32"
        if wanted != mode:
            raise ConfigError("data_types.param_dtype",
                              f"{wanted!r} conflicts with the enabled precision mode ({mode}); set the matching "
                              f"fp16/bf16 'enabled' flag or remove data_types.param_dtype")

    @property
    def compute_dtype(self) -> "torch.dtype":
        """The dtype of forward/backward: bfloat16, float16 or float32."""
        import torch  # lazy: importing the config must stay cheap

        if self.bf16.enabled is True:
            return torch.bfloat16
        if self.fp16.enabled is True:
            return torch.float16
        return torch.float32


_LOG_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}  # logging's numbers


def log_level_number(value: Any) -> int | None:
    """``log_level`` as a ``logging`` level (DeepSpeed's names, any case); None when unset."""
    if value is None:
        return None
    level = _LOG_LEVELS.get(value.lower()) if isinstance(value, str) else None
    if level is None:
        raise ConfigError("log_level", f"{value!r} is not a logging level; use one of {', '.join(_LOG_LEVELS)}")
    return level


def not_implemented(cfg: HfZeroConfig) -> tuple[str, ...]:
    """The keys ``cfg`` sets that hf_zero accepts but does not run yet, in schema order (see :mod:`.status`)."""
    from .status import Status, not_honoured

    return tuple(label for label, entry in not_honoured(cfg) if entry.status is Status.NOT_IMPLEMENTED)
