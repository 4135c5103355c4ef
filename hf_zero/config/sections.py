"""The typed sections of a DeepSpeed config: precision, ZeRO, offload, async I/O, monitors, checkpointing, curriculum.

Each class mirrors one JSON object, with DeepSpeed's key names and defaults (``deepspeed/runtime/zero/config.py``,
``offload_config.py``, ``precision_config.py``), so a config written for DeepSpeed means the same thing here.
Checks that involve more than one key of a section live in its ``__post_init__`` and raise :class:`ConfigError`
with the key relative to the section; :func:`schema.parse` prefixes the section's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .errors import ConfigError
from .policies import NO_PERSISTENCE_CAP
from .schema import AUTO, Auto, spec
from .zenflow import ZenFlowConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "CheckpointConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "CurriculumLearningConfig",
    "CurriculumScheduleConfig",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "LEAF_MODULE_DEFAULT_CLASSES",
    "LeafModuleConfig",
    "MonitorConfig",
    "OffloadConfig",
    "ParamOffloadConfig",
    "ProgressiveLayerDropConfig",
    "ThroughputTimerConfig",
    "TimersConfig",
    "TorchAutocastConfig",
    "WandbConfig",
    "ZeroConfig",
]

OffloadDevice = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """``fp16``: mixed precision with float16 weights and (dynamic) loss scaling."""

    enabled: bool | Auto = spec(False, auto=True, help="Train in float16 with loss scaling.")
    auto_cast: bool = spec(False, help="Cast floating-point inputs of the model's forward to float16.")
    loss_scale: float = spec(0.0, help="Static loss scale; 0 selects dynamic loss scaling.")
    initial_scale_power: int = spec(16, help="Dynamic loss scaling starts at 2**initial_scale_power.")
    loss_scale_window: int = spec(1000, help="Steps without overflow before the dynamic loss scale is raised.")
    hysteresis: int = spec(2, help="Overflows tolerated before the dynamic loss scale is lowered.")
    consecutive_hysteresis: bool = spec(False, help="Refill the hysteresis budget after every step without overflow.")
    min_loss_scale: float = spec(1.0, help="The dynamic loss scale never drops below this.")
    fp16_master_weights_and_grads: bool = spec(False, help="Keep master weights and gradients in fp16 (CPU Adam only).")

    def __post_init__(self) -> None:
        if not (self.loss_scale >= 0 and self.loss_scale != float("inf")):
            raise ConfigError("loss_scale", f"must be a finite number >= 0 (0 = dynamic), got {self.loss_scale}")
        if self.min_loss_scale <= 0:
            raise ConfigError("min_loss_scale", f"must be > 0, got {self.min_loss_scale}")
        for key in ("loss_scale_window", "hysteresis"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    """``bf16`` (legacy name ``bfloat16``): mixed precision with bfloat16 weights, no loss scaling."""

    enabled: bool | Auto = spec(False, auto=True, help="Train in bfloat16.")
    immediate_grad_update: bool = spec(False, help="Apply gradient updates immediately rather than delayed.")
    check_grad_overflow: bool = spec(False, help="Check bfloat16 gradients for overflow and skip such steps.")
    bf16_master_weights_and_grads: bool = spec(False, help="Keep master weights and gradients in bf16 (ZeRO).")
    bf16_optimizer_states: bool = spec(False, help="Keep optimizer states in bf16 (needs bf16 master weights).")


AUTOCAST_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
                   "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16"}


@dataclass(frozen=True, kw_only=True)
class TorchAutocastConfig:
    """``torch_autocast``: the forward runs under ``torch.autocast``. Alone, parameters and master weights stay fp32
    (DeepSpeed's alternative to the ``bf16`` / ``fp16`` sections, which cast the model). Together with ``bf16`` or
    ``fp16`` enabled, both apply, as in DeepSpeed 0.19: the section casts the parameters (fp32 masters, or bf16 ones
    with ``bf16_master_weights_and_grads``) and the forward still runs under autocast, which also takes fp32 inputs
    and runs autocast's fp32 ops (losses, norms, softmax) in fp32."""

    enabled: bool = spec(False, help="Run the forward under torch.autocast.")
    dtype: str | None = spec(None, help="bfloat16 or float16; default: the device's autocast dtype (CPU: "
                                        "bfloat16, CUDA: float16). float16 adds dynamic loss scaling (fp16 "
                                        "section's settings).")
    lower_precision_safe_modules: tuple[str, ...] | None = spec(
        None, help="Module classes (package.Class) whose gradients DeepSpeed reduces in the autocast dtype.")

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in AUTOCAST_DTYPES:
            raise ConfigError("dtype", f"{self.dtype!r} is not an autocast dtype; use bfloat16 or float16")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """``zero_optimization.offload_optimizer`` / ``offload_param``: where states live when not on the accelerator."""

    _unsupported_keys: ClassVar[dict[str, str]] = {
        "super_offload": "SuperOffload for Superchips",
        "convert_grad_on_cpu": "SuperOffload's gradient conversion",
        "cpuadam_cores_perc": "SuperOffload's CPU Adam core share",
    }

    device: OffloadDevice | Auto = spec("none", auto=True, help="Offload target: 'none', 'cpu' or 'nvme'.")
    nvme_path: str | None | Auto = spec(None, auto=True, help="Directory on an NVMe drive; required for 'nvme'.")
    pin_memory: bool = spec(False, help="Use page-locked CPU memory: faster copies, more host memory pinned.")
    buffer_count: int = spec(4, help="Buffers in the NVMe swap pool (>= states per parameter: 4 for Adam).")
    buffer_size: int = spec(100_000_000, help="Elements per NVMe swap buffer.")
    max_in_cpu: int = spec(1_000_000_000, help="Parameter elements kept in CPU memory when offloading to NVMe.")
    fast_init: bool = spec(False, help="Fast optimizer initialisation when offloading to NVMe.")
    pipeline_read: bool = spec(False, help="Overlap reading the next tile from NVMe with the current tile's step.")
    pipeline_write: bool = spec(False, help="Overlap writing the previous tile to NVMe with the current tile's step.")
    ratio: float = spec(1.0, help="Fraction of the optimizer state to offload (partial offload), 0 < ratio <= 1.")

    def __post_init__(self) -> None:
        if self.device == "nvme" and self.nvme_path is None:
            raise ConfigError("nvme_path", "required when device is 'nvme': give a directory on the NVMe drive")
        if not 0.0 < self.ratio <= 1.0:
            raise ConfigError("ratio", f"value {self.ratio} is not accepted; use a fraction with 0 < ratio <= 1")
        for key in ("buffer_count", "buffer_size", "max_in_cpu"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True, kw_only=True)
class ParamOffloadConfig(OffloadConfig):
    """``zero_optimization.offload_param``: as :class:`OffloadConfig`, with DeepSpeed's 5 swap buffers."""

    buffer_count: int = spec(5, help="Buffers in the NVMe parameter swap pool.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratio != 1.0:
            raise ConfigError("ratio", f"value {self.ratio} is not accepted here; ratio applies to offload_optimizer")


# DeepSpeed's default ``zero_optimization.leaf_module.classes``: its ZeRO-3 gathers these mixture-of-experts blocks as
# one unit, and reduces their parameters together (zeros for the experts a rank's tokens did not reach), unless the
# config names other classes. Same list, so one config means the same on both engines.
LEAF_MODULE_DEFAULT_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


@dataclass(frozen=True, kw_only=True)
class LeafModuleConfig:
    """``zero_optimization.leaf_module``: the ZeRO-3 leaf modules a config chooses (hf_zero/zero/leaf.py), matched
    by class (``"Name"`` or ``"package.module.Name"``), by ``named_modules()`` name, or by name suffix. A single
    string stands for a list of one, as in DeepSpeed."""

    classes: tuple[str, ...] | str = spec(LEAF_MODULE_DEFAULT_CLASSES,
                                          help="Module classes made leaves (default: DeepSpeed's MoE blocks).")
    names: tuple[str, ...] | str = spec((), help="Modules made leaves, by their named_modules() name.")
    name_suffixes: tuple[str, ...] | str = spec((), help="Modules made leaves, by a suffix of their name.")

    def __post_init__(self) -> None:
        for key in ("classes", "names", "name_suffixes"):
            value = getattr(self, key)
            object.__setattr__(self, key, tuple(dict.fromkeys((value,) if isinstance(value, str) else value)))

    @property
    def customized(self) -> bool:
        """The config changed DeepSpeed's defaults: what then matches no module is worth a warning."""
        return self.classes != LEAF_MODULE_DEFAULT_CLASSES or bool(self.names) or bool(self.name_suffixes)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """``zero_optimization``: which states are partitioned across data-parallel ranks, and how they move."""

    _unsupported_keys: ClassVar[dict[str, str]] = {
        "zeropp_loco_param": "LoCo-ZeRO++",
        "stage3_partition_stream_chunk_size": "Streamed partitioning of huge parameters",
        "save_muon_momentum_buffer_in_memory": "Muon momentum buffers",
    }

    stage: Literal[0, 1, 2, 3] | Auto = spec(
        0, auto=True, help="0 off; 1 optimizer states, 2 + gradients, 3 + parameters partitioned across ranks.")
    contiguous_gradients: bool = spec(True, help="Copy gradients into one contiguous buffer as they are produced.")
    reduce_scatter: bool = spec(True, help="Average gradients with reduce-scatter instead of all-reduce.")
    reduce_bucket_size: int | Auto = spec(500_000_000, auto=True, help="Elements reduced per bucket.")
    use_multi_rank_bucket_allreduce: bool = spec(True, help="All-reduce the buckets of all ranks together.")
    allgather_partitions: bool = spec(True, help="All-gather updated partitions (else a series of broadcasts).")
    allgather_bucket_size: int | Auto = spec(500_000_000, auto=True, help="Elements all-gathered per bucket.")
    overlap_comm: bool | None = spec(None, help="Overlap gradient reduction with backward; default true at stage 3.")
    load_from_fp32_weights: bool = spec(True, help="Restore fp32 master weights from the checkpoint's fp32 copy.")
    elastic_checkpoint: bool = spec(False, help="Legacy elastic checkpoints (hf_zero checkpoints are always elastic).")
    offload_optimizer: OffloadConfig = spec(
        default_factory=OffloadConfig, help="Offload optimizer states and the optimizer step to CPU or NVMe.")
    offload_param: ParamOffloadConfig = spec(
        default_factory=ParamOffloadConfig, help="Offload parameters to CPU or NVMe (stage 3).")
    sub_group_size: int = spec(1_000_000_000, help="Parameter elements processed per optimizer-step tile.")
    zenflow: ZenFlowConfig | None = spec(
        None, help="ZenFlow (stages 1-3 with offload_optimizer): top-k gradient columns updated on the device every "
                   "step, the rest by the offloaded optimizer every update_interval steps (docs/zenflow.md).")
    cpu_offload: bool | None = spec(None, help="Legacy: true means offload_optimizer.device 'cpu'.")
    cpu_offload_param: bool | None = spec(None, help="Legacy: true means offload_param.device 'cpu'.")
    cpu_offload_use_pin_memory: bool | None = spec(None, help="Legacy: pin_memory of the legacy cpu offloads.")
    # DeepSpeed's field names (without "stage3_") are accepted as aliases, as its config model accepts them
    stage3_prefetch_bucket_size: int | Auto = spec(
        50_000_000, auto=True, aliases=("prefetch_bucket_size",),
        help="Stage 3: parameter elements fetched ahead of use.")
    stage3_param_persistence_threshold: int | Auto = spec(
        100_000, auto=True, aliases=("param_persistence_threshold",),
        help="Stage 3: parameters with fewer elements are not partitioned.")
    stage3_model_persistence_threshold: int = spec(
        NO_PERSISTENCE_CAP, aliases=("model_persistence_threshold",),
        help="Stage 3: upper bound on the elements kept unpartitioned by the persistence threshold.")
    stage3_max_live_parameters: int = spec(1_000_000_000, aliases=("max_live_parameters",),
                                           help="Stage 3: parameter elements resident per rank.")
    stage3_max_reuse_distance: int = spec(
        1_000_000_000, aliases=("max_reuse_distance",),
        help="Stage 3: keep a parameter gathered if it is used again within this many elements. Left out of the "
             "config, hf_zero uses 0 (re-gather for backward; docs/zero_memory.md).")
    stage3_gather_16bit_weights_on_model_save: bool | Auto = spec(
        False, auto=True, aliases=("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"),
        help="Stage 3: gather full 16-bit weights when saving the model (save_16bit_model, Trainer.save_model).")
    stage3_divergence_timeout_s: float = spec(
        300.0, help="Stage 3 (hf_zero): seconds a parameter gather may wait for the other ranks before the job "
                    "fails with an error naming the module and the ranks that diverged, instead of hanging.")
    stage3_module_granularity_threshold: int = spec(
        0, aliases=("module_granularity_threshold",),
        help="Stage 3: modules with at most this many parameters per layer (DeepSpeed's measure) are gathered as one "
             "unit, as leaf modules; 0: off.")
    leaf_module: LeafModuleConfig = spec(
        default_factory=LeafModuleConfig, help="Stage 3: modules gathered as one unit, whose gradients are reduced "
                                               "together when their backward ends (hf_zero/zero/leaf.py).")
    pipeline_loading_checkpoint: bool = spec(
        False, help="Stage 3: DeepSpeed loads a checkpoint one local rank after another (to bound host memory).")
    stage3_use_all_reduce_for_fetch_params: bool = spec(False, aliases=("use_all_reduce_for_fetch_params",),
                                                        help="Stage 3: fetch parameters with all-reduce.")
    stage3_allgather_sequential: bool = spec(
        False, aliases=("allgather_sequential",), help="Stage 3: all-gather parameters one by one, without buckets.")
    ignore_unused_parameters: bool = spec(True, help="Tolerate parameters that receive no gradient.")
    compute_grad_norm: bool = spec(
        True, help="false: the optimizer step computes no global gradient norm (one reduction fewer per step; "
                   "engine.get_global_grad_norm() is None). Needs gradient_clipping 0, as in DeepSpeed.")
    parameter_alignment: bool = spec(
        False, help="DeepSpeed stages 1/2: start each parameter at a 16-byte boundary of its flat buffer.")
    legacy_stage1: bool = spec(False, help="Legacy DeepSpeed stage 1 implementation; same as stage 1 here.")
    round_robin_gradients: bool = spec(False, help="Stage 1/2 with CPU offload: spread gradient copies over ranks.")
    zero_hpz_partition_size: int = spec(1, help="ZeRO++ hierarchical partitioning: ranks in the secondary group.")
    zero_quantized_weights: bool = spec(False, help="ZeRO++: quantize weights for all-gather.")
    zero_quantized_nontrainable_weights: bool = spec(False, help="ZeRO++: store frozen weights quantized.")
    zero_quantized_gradients: bool = spec(False, help="ZeRO++: quantize gradients for reduction.")
    mics_shard_size: int = spec(-1, help="MiCS: ranks per shard group; -1 off.")
    mics_hierarchical_params_gather: bool = spec(False, help="MiCS: hierarchical parameter all-gather.")
    memory_efficient_linear: bool = spec(True, help="Stage 3: memory-efficient linear layer.")
    override_module_apply: bool = spec(True, help="Stage 3: gather parameters inside nn.Module.apply.")
    log_trace_cache_warnings: bool = spec(False, help="Stage 3: log trace-cache invalidations.")
    enable_sanity_checks: bool = spec(False, help="Internal consistency checks (slow; for debugging).")

    def __post_init__(self) -> None:
        for key in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "stage3_prefetch_bucket_size",
                    "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
                    "stage3_max_live_parameters", "stage3_max_reuse_distance", "zero_hpz_partition_size"):
            value = getattr(self, key)
            if not isinstance(value, Auto) and value < 0:
                raise ConfigError(key, f"must be >= 0, got {value}")
        # The legacy booleans become the offload sections they stand for; both forms at once must agree.
        for legacy, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            flag = getattr(self, legacy)
            if flag is None:
                continue
            current: OffloadConfig = getattr(self, section)
            if flag and current.device == "none":
                pin = bool(self.cpu_offload_use_pin_memory)
                object.__setattr__(self, section, type(current)(device="cpu", pin_memory=pin))
            elif flag and current.device not in ("cpu", "none"):
                raise ConfigError(legacy, f"true means {section}.device 'cpu' but {section}.device is "
                                  f"{current.device!r}; remove {legacy}")
            elif not flag and current.device not in ("none",):
                raise ConfigError(legacy, f"false contradicts {section}.device {current.device!r}; remove {legacy}")
        if self.overlap_comm is None and not isinstance(self.stage, Auto):
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        if self.zenflow is not None:  # DeepSpeed's checks, at its ZenFlow optimizer's construction
            if not self.offload_optimizer.enabled:
                raise ConfigError("zenflow", "needs offload_optimizer (device 'cpu'): ZenFlow applies the "
                                             "unselected gradients with the offloaded optimizer")
            if self.offload_optimizer.ratio != 1.0:  # a resident master would share the weights' memory
                raise ConfigError("zenflow", "with offload_optimizer.ratio < 1 is not implemented in hf_zero")
            if self.zenflow.offload and self.overlap_comm is False:
                raise ConfigError("zenflow.offload", "true needs overlap_comm true (DeepSpeed's rule)")

    @property
    def offload_enabled(self) -> bool:
        return self.offload_optimizer.enabled or self.offload_param.enabled

    @property
    def checks_unused_parameters(self) -> bool:
        """``ignore_unused_parameters: false`` where DeepSpeed checks it: only its offloaded per-parameter norm
        (offload_optimizer at stages 1-2) reads the key; elsewhere it changes nothing (config/status.py says so)."""
        return not self.ignore_unused_parameters and self.stage in (1, 2) and self.offload_optimizer.enabled

    @property
    def gather_16bit_weights_on_model_save(self) -> bool:
        """``stage3_gather_16bit_weights_on_model_save`` under the attribute name DeepSpeed's engine code uses."""
        return self.stage3_gather_16bit_weights_on_model_save is True


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """``aio``: the asynchronous file I/O used for NVMe offload."""

    block_size: int = spec(1_048_576, help="Bytes per I/O request.")
    queue_depth: int = spec(8, help="I/O requests in flight.")
    intra_op_parallelism: int = spec(1, aliases=("thread_count",), help="Threads submitting I/O per operation.")
    single_submit: bool = spec(False, help="Submit requests one at a time instead of in batches.")
    overlap_events: bool = spec(True, help="Overlap submitting requests with waiting for completions.")
    use_gds: bool = spec(False, help="Use NVIDIA GPUDirect Storage.")

    def __post_init__(self) -> None:
        for key in ("block_size", "queue_depth", "intra_op_parallelism"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: options of DeepSpeed's activation checkpointing API."""

    # DeepSpeed parses this section key by key and ignores the rest: unknown keys warn instead of failing
    _ignores_unknown_keys: ClassVar[bool] = True

    partition_activations: bool = spec(False, help="Partition checkpointed activations across model-parallel ranks.")
    contiguous_memory_optimization: bool = spec(False, help="Copy checkpoints into one contiguous buffer.")
    cpu_checkpointing: bool = spec(False, help="Move checkpointed activations to CPU memory.")
    number_checkpoints: int | None = spec(None, help="Number of checkpoints (for the contiguous buffer).")
    synchronize_checkpoint_boundary: bool = spec(False, help="Synchronize the device at each checkpoint boundary.")
    profile: bool = spec(False, help="Time the checkpointing forward and backward.")

    @property
    def enabled(self) -> bool:
        return self.partition_activations or self.contiguous_memory_optimization or self.cpu_checkpointing


@dataclass(frozen=True, kw_only=True)
class FlopsProfilerConfig:
    """``flops_profiler``: DeepSpeed's FLOPs profiler."""

    # DeepSpeed parses this section key by key and ignores the rest: unknown keys warn instead of failing
    _ignores_unknown_keys: ClassVar[bool] = True

    enabled: bool = spec(False, help="Profile FLOPs, parameters and latency of one step.")
    recompute_fwd_factor: float = spec(0.0, help="Extra forward passes from activation recomputation.")
    profile_step: int = spec(1, help="The step to profile.")
    module_depth: int = spec(-1, help="Module depth to report; -1 for all.")
    top_modules: int = spec(1, help="Top modules to list.")
    detailed: bool = spec(True, help="Print the per-module profile.")
    output_file: str | None = spec(None, help="Write the profile here instead of stdout.")


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """``tensorboard`` / ``csv_monitor``: training metrics written to files on global rank 0 (runtime/monitor.py)."""

    enabled: bool = spec(False, help="Write metrics (tensorboard needs the `tensorboard` package).")
    output_path: str = spec("", help="Directory the job's directory is made in; empty: the working directory.")
    job_name: str = spec("DeepSpeedJobName", help="The directory under output_path the files are written to.")


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """``wandb``: log training metrics to Weights & Biases (needs the ``wandb`` package)."""

    enabled: bool = spec(False, help="Log metrics to W&B.")
    group: str | None = spec(None, help="W&B group (wandb.init's group).")
    team: str | None = spec(None, help="W&B team (wandb.init's entity).")
    project: str = spec("deepspeed", help="W&B project.")


@dataclass(frozen=True, kw_only=True)
class CometConfig:
    """``comet``: log training metrics to a Comet experiment (needs ``comet_ml`` >= 3.41.0). The keys left unset
    fall back to Comet's own configuration (``.comet.config``, ``COMET_*`` environment variables)."""

    enabled: bool = spec(False, help="Log metrics to Comet.")
    samples_log_interval: int = spec(100, help="A metric is sent again only after this many more training samples.")
    project: str | None = spec(None, help="Comet project name.")
    workspace: str | None = spec(None, help="Comet workspace name.")
    api_key: str | None = spec(None, help="Comet API key.")
    experiment_name: str | None = spec(None, help="Name given to the experiment.")
    experiment_key: str | None = spec(None, help="Key of the experiment (32-50 alphanumeric characters).")
    online: bool | None = spec(None, help="Send to the Comet server (true) or keep an offline experiment (false).")
    mode: Literal["get", "create", "get_or_create"] | None = spec(
        None, help="Continue an existing experiment ('get'), always start one ('create'), or either.")


@dataclass(frozen=True, kw_only=True)
class CommsLoggerConfig:
    """``comms_logger``: log every collective with its size and time."""

    enabled: bool = spec(False, help="Log collectives.")
    verbose: bool = spec(False, help="Print each collective as it happens.")
    prof_all: bool = spec(True, help="Profile all collectives.")
    debug: bool = spec(False, help="Add the calling function to each record.")
    prof_ops: tuple[str, ...] = spec((), help="Only these collectives (when prof_all is false).")


@dataclass(frozen=True, kw_only=True)
class ThroughputTimerConfig:
    """``timers.throughput``: the engine's samples-per-second meter (``engine.tput_timer``)."""

    enabled: bool = spec(True, help="Time each micro-step and log samples/s every steps_per_print steps.")
    synchronized: bool = spec(True, help="Synchronise the device before reading the clock (CUDA is asynchronous).")


@dataclass(frozen=True, kw_only=True)
class TimersConfig:
    """``timers``: DeepSpeed's timer settings."""

    throughput: ThroughputTimerConfig = spec(default_factory=ThroughputTimerConfig, help="engine.tput_timer.")


@dataclass(frozen=True, kw_only=True)
class HybridEngineConfig:
    """``hybrid_engine``: DeepSpeed's RLHF hybrid engine -- the training engine also generates (the actor's rollouts
    in DeepSpeed-Chat's step 3). hf_zero/runtime/hybrid_engine.py."""

    enabled: bool = spec(False, help="engine.generate / module.generate run with the ZeRO-3 parameters gathered "
                                     "once per call (pin_parameters); RNG states synced from rank 0 at start.")
    max_out_tokens: int = spec(512, help="Sizes DeepSpeed's inference-kernel workspace (hf_zero has none).")
    inference_tp_size: int = spec(1, help="Tensor-parallel size of DeepSpeed's injected generation kernels.")
    release_inference_cache: bool = spec(False, help="Free DeepSpeed's inference workspace after each generate().")
    pin_parameters: bool = spec(True, help="ZeRO-3: gather every parameter once for a whole generate() call (true) "
                                           "or layer by layer at each decoding step (false).")
    tp_gather_partition_size: int = spec(8, help="Layers gathered at a time with inference_tp_size > 1.")
    enable_cuda_graph: bool = spec(False, help="Replay decoding steps as CUDA graphs (DeepSpeed's injected path).")

    def __post_init__(self) -> None:
        if self.max_out_tokens < 1:
            raise ConfigError("max_out_tokens", f"must be > 0, got {self.max_out_tokens}")
        for key in ("inference_tp_size", "tp_gather_partition_size"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """``checkpoint``: how checkpoints are tagged, written and loaded."""

    tag_validation: Literal["ignore", "warn", "fail"] = spec(
        "warn", help="What to do when ranks save under different tags: 'Ignore', 'Warn' or 'Fail'.")
    load_universal: bool = spec(False, help="Load a DeepSpeed universal checkpoint.")
    use_node_local_storage: bool | Auto = spec(
        False, auto=True, help="Every node writes its own checkpoint copy (non-shared file systems).")
    parallel_write: dict | None = spec(None, help="DeepSpeed parallel-write options (pipeline_stage).")


@dataclass(frozen=True, kw_only=True)
class DataTypesConfig:
    """``data_types``: dtypes of internal buffers."""

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = spec(
        None, help="Dtype gradients are accumulated in; default: the training dtype.")
    param_dtype: Literal["fp32", "fp16", "bf16"] | None = spec(
        None, help="Dtype of the model's parameters; must match the enabled fp16/bf16 mode (DeepSpeed's check).")
    buffer_dtype: Literal["fp32", "fp16", "bf16"] | None = spec(
        None, help="Cast floating buffers (BatchNorm statistics, rotary frequencies) to this dtype at initialize "
                   "under fp16/bf16; default: buffers keep the dtype they arrive in.")
    keep_in_fp32_modules: tuple[str, ...] | Auto = spec(
        AUTO, auto=True, help="Buffers kept in fp32 under fp16/bf16: 'auto' (the model's transformers "
                              "_keep_in_fp32_modules_strict lists, and _keep_in_fp32_modules under fp16), name "
                              "patterns ('*' for any characters), or [] for none.")



@dataclass(frozen=True, kw_only=True)
class CurriculumScheduleConfig:
    """``curriculum_learning.schedule_config``: the parameters of the chosen ``schedule_type`` (which ones are
    required is checked by :class:`CurriculumLearningConfig`)."""

    total_curriculum_step: int | None = spec(
        None, help="fixed_linear / fixed_root: steps to go from min_difficulty to max_difficulty.")
    difficulty_step: int | None = spec(
        None, help="fixed_linear / fixed_root: every difficulty is a multiple of this (8 for fp16 Tensor Cores).")
    root_degree: int | None = spec(None, help="fixed_root: degree of the root (2: square root; 1 is linear).")
    difficulty: tuple[int, ...] | None = spec(None, help="fixed_discrete: the difficulties, in order.")
    max_step: tuple[int, ...] | None = spec(
        None, help="fixed_discrete: the last step of each difficulty but the last (one entry fewer).")


@dataclass(frozen=True, kw_only=True)
class ProgressiveLayerDropConfig:
    """``progressive_layer_drop``: DeepSpeed's PLD (arXiv 2010.13369). While training, every forward gets
    ``progressive_layer_drop=True, pld_theta=theta`` (the model decides what to drop), ``theta`` moving from 1 towards
    ``theta`` at each optimizer step: ``(1 - theta) * exp(-gamma * step) + theta`` (hf_zero/runtime/pld.py)."""

    enabled: bool = spec(False, help="Pass the keep-probability schedule to the model's forward.")
    theta: float = spec(1.0, help="The keep probability the schedule converges to (1: nothing dropped).")
    gamma: float = spec(0.001, help="How fast the keep probability falls towards theta.")

    def __post_init__(self) -> None:
        if not 0.0 <= self.theta <= 1.0:
            raise ConfigError("theta", f"{self.theta} is not a probability (0 <= theta <= 1)")
        if self.gamma < 0:
            raise ConfigError("gamma", f"must be >= 0, got {self.gamma}")


@dataclass(frozen=True, kw_only=True)
class CurriculumLearningConfig:
    """``curriculum_learning``: DeepSpeed's legacy curriculum (Megatron-DeepSpeed's). While training, each forward
    sets the difficulty for step ``global_steps + 1`` and, for ``curriculum_type`` seqlen, passes it to the model
    as ``curriculum_seqlen=`` (hf_zero/runtime/curriculum.py)."""

    enabled: bool = spec(False, help="Run the curriculum.")
    curriculum_type: str | None = spec(
        None, help="What the difficulty is; 'seqlen' passes it to the model's forward as curriculum_seqlen.")
    min_difficulty: int | None = spec(None, help="The difficulty of the first step.")
    max_difficulty: int | None = spec(None, help="The difficulty the schedule ends at.")
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"] | None = spec(
        None, help="fixed_linear, fixed_root, fixed_discrete, or custom (engine.curriculum_scheduler_legacy"
                   ".set_custom_get_difficulty(fn)).")
    schedule_config: CurriculumScheduleConfig = spec(
        default_factory=CurriculumScheduleConfig, help="The schedule's parameters.")

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        for key in ("curriculum_type", "min_difficulty", "max_difficulty", "schedule_type"):
            if getattr(self, key) is None:
                raise ConfigError(key, "required when curriculum_learning is enabled")
        if self.min_difficulty > self.max_difficulty:
            raise ConfigError("min_difficulty", f"{self.min_difficulty} is above max_difficulty "
                                                f"{self.max_difficulty}; the schedule goes from min to max")
        sched = self.schedule_config
        needed = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
                  "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
                  "fixed_discrete": ("difficulty", "max_step"), "custom": ()}[self.schedule_type]
        for key in needed:
            if getattr(sched, key) is None:
                raise ConfigError(f"schedule_config.{key}", f"required by schedule_type {self.schedule_type!r}")
        for key in ("total_curriculum_step", "difficulty_step", "root_degree"):
            if key in needed and getattr(sched, key) < 1:
                raise ConfigError(f"schedule_config.{key}", f"must be >= 1, got {getattr(sched, key)}")
        if self.schedule_type == "fixed_discrete":
            if not sched.max_step or len(sched.difficulty) != len(sched.max_step) + 1:
                raise ConfigError("schedule_config.max_step",
                                  f"needs at least one entry, and one fewer than schedule_config.difficulty (the "
                                  f"last difficulty holds for every later step): got {len(sched.max_step)} max_step "
                                  f"for {len(sched.difficulty)} difficulty")
            if list(sched.max_step) != sorted(sched.max_step):
                raise ConfigError("schedule_config.max_step", f"{list(sched.max_step)} must be in ascending order")
