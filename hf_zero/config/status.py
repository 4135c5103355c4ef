"""What hf_zero does with every DeepSpeed key it accepts: one table, one line per key.

Each accepted JSON key (dotted path; a section's path covers every key inside it) has one status:

* ``honoured`` -- it changes behaviour as DeepSpeed documents.
* ``no_op``    -- accepted on purpose and without effect, with the reason (hf_zero already behaves that way, or the
  option tunes a mechanism hf_zero does not have). Setting it away from its default warns once, naming the key.
* ``not_implemented`` -- DeepSpeed would do something hf_zero does not do (yet). Setting it warns once, naming the
  key and what hf_zero does instead; the start-up table lists it.
* ``refused`` -- ignoring it would silently change results, so a value hf_zero cannot honour is a ConfigError.

"Set" means: the value differs from the default, unless the entry names its own condition (``active``): a section
with an ``enabled`` flag is set when enabled. Landing a feature is a one-line edit here: its status becomes
``HONOURED``. ``tests/test_config_status.py`` fails when an accepted key has no entry.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .boolean import truthy
from .errors import ConfigError

if TYPE_CHECKING:
    from .hf_zero_config import HfZeroConfig

__all__ = ["Status", "KeyStatus", "STATUS", "ConfigKeyIgnored", "not_honoured", "enforce"]


class Status(enum.Enum):
    HONOURED = "honoured"
    NO_OP = "no effect"
    NOT_IMPLEMENTED = "not implemented"
    REFUSED = "refused"


class ConfigKeyIgnored(UserWarning):
    """A config key hf_zero accepts is set, but hf_zero does not do what it asks; the message says what instead."""


@dataclass(frozen=True)
class KeyStatus:
    status: Status
    note: str = ""  # no_op: why; not_implemented / refused: what hf_zero does instead
    active: Callable[["HfZeroConfig"], bool] | None = None  # when the key counts as set; default: != its default
    label: Callable[["HfZeroConfig"], str] | None = None    # how the start-up table names it; default: the path


HONOURED = KeyStatus(Status.HONOURED)


def _no_op(note: str, active=None) -> KeyStatus:
    return KeyStatus(Status.NO_OP, note, active)


def _todo(note: str, active=None, label=None) -> KeyStatus:
    return KeyStatus(Status.NOT_IMPLEMENTED, note, active, label)


def _refused(note: str, active=None) -> KeyStatus:
    return KeyStatus(Status.REFUSED, note, active)


def _zenflow_set(name: str, default: Any) -> Callable[["HfZeroConfig"], bool]:
    """A key of the optional ``zero_optimization.zenflow`` section: set when the section is and the key differs."""
    return lambda cfg: cfg.zero.zenflow is not None and getattr(cfg.zero.zenflow, name) != default


def _switched_on(path: str) -> Callable[["HfZeroConfig"], bool]:
    """A section kept as a raw mapping counts as set when it has ``"enabled": true`` at any depth."""
    return lambda cfg: _any_enabled(_get(cfg, path))


def _any_enabled(section: Any) -> bool:
    if isinstance(section, Mapping):
        return truthy(section.get("enabled")) or any(_any_enabled(v) for v in section.values())
    if isinstance(section, (list, tuple)):
        return any(_any_enabled(v) for v in section)
    return False


def _data_efficiency_beyond_batching(cfg: "HfZeroConfig") -> bool:
    """``data_efficiency`` asks for more than dynamic batching and random-LTD: curriculum sampling."""
    section = _get(cfg, "data_efficiency")
    if not isinstance(section, Mapping):
        return False
    sampling = section.get("data_sampling")
    rest = {k: v for k, v in sampling.items() if k != "dynamic_batching"} if isinstance(sampling, Mapping) else {}
    return any(_any_enabled(v) for v in rest.values())


def _given_true(path: str) -> Callable[["HfZeroConfig"], bool]:
    """Set when the user wrote ``true`` (the default is true, and hf_zero behaves as ``false``)."""
    def active(cfg: "HfZeroConfig") -> bool:
        node: Any = cfg.raw
        for part in path.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        return node is True
    return active


def _hybrid_set(key: str) -> Callable[["HfZeroConfig"], bool]:
    """A ``hybrid_engine`` key counts as set only with the engine enabled: DeepSpeed-Chat writes every key with
    ``enabled: false`` too, and then none of them does anything in DeepSpeed either."""
    def active(cfg: "HfZeroConfig") -> bool:
        section = cfg.hybrid_engine
        return section.enabled and getattr(section, key) != getattr(type(section)(), key)
    return active


def _one_bit(cfg: "HfZeroConfig") -> bool:
    from .optim import ONE_BIT_OPTIMIZERS

    return cfg.optimizer is not None and cfg.optimizer.name in ONE_BIT_OPTIMIZERS


def _optimizer_key_given(name: str) -> Callable[["HfZeroConfig"], bool]:
    """A key of the optional ``optimizer`` section that defaults to None: set when the section is and the key given."""
    return lambda cfg: cfg.optimizer is not None and getattr(cfg.optimizer, name) is not None


def _optimizer_label(cfg: "HfZeroConfig") -> str:
    from .optim import OPTIMIZER_TYPES

    return f"optimizer.type {OPTIMIZER_TYPES[cfg.optimizer.name][0]}"


def _reduce_dtype(cfg: "HfZeroConfig") -> str:
    """The dtype gradients are reduced in: the one they are accumulated in."""
    if cfg.data_types.grad_accum_dtype is not None:
        return cfg.data_types.grad_accum_dtype
    return "bf16" if cfg.bf16.enabled is True else "fp16" if cfg.fp16.enabled is True else "fp32"


_REDUCE_DTYPE = ("gradients are reduced in the dtype they are accumulated in; set data_types.grad_accum_dtype to "
                 "choose it")

_OFFLOAD_POOL = ("hf_zero's swap needs no buffer pool: optimizer tiles use two sets of sub_group_size buffers, and "
                 "parameter reads go straight into the all-gather buffer")
_PIPELINED = "NVMe reads and writes always overlap the optimizer step (double-buffered tiles)"

# Dotted JSON key -> status. Aliases (bfloat16, thread_count, stage3_gather_fp16_weights_on_model_save) share the
# entry of the key they stand for.
STATUS: dict[str, KeyStatus] = {
    "train_batch_size": HONOURED,
    "train_micro_batch_size_per_gpu": HONOURED,
    "gradient_accumulation_steps": HONOURED,
    "gradient_clipping": HONOURED,
    "steps_per_print": HONOURED,
    "managed_gradient_accumulation": HONOURED,  # runtime/engine.py: step() as the boundary when false
    "wall_clock_breakdown": HONOURED,
    "timers": HONOURED,  # timers.throughput drives engine.tput_timer (hf_zero/profiling/throughput_timer.py)
    "disable_python_gc": HONOURED,  # runtime/python_gc.py, held by the engine until destroy()
    "log_level": HONOURED,  # runtime/initialize.py sets hf_zero's (DeepSpeed's) logger level
    "memory_breakdown": HONOURED,  # the engine prints memory at each stage of a step (profiling/memory_usage.py)
    "dump_state": HONOURED,  # initialize() logs the resolved config and engine state (runtime/state_dump.py)
    "prescale_gradients": _no_op("hf_zero always divides gradients by the world size before reducing them, as "
                                 "DeepSpeed's ZeRO reduce-scatter path does"),
    "gradient_predivide_factor": _no_op("hf_zero divides each gradient by the data-parallel size before it is "
                                        "reduced; DeepSpeed's factor splits that division between before and "
                                        "after the reduction (1/f, then f/world), the same gradient up to "
                                        "rounding"),
    "gradient_allreduce_op": HONOURED,  # 'sum': the reducers skip the 1/world division (zero/grad_reducer.py)
    "sparse_gradients": _todo("embedding gradients are reduced as dense tensors (same values)"),
    "zero_allow_untested_optimizer": HONOURED,
    "dataloader_drop_last": HONOURED,
    "use_data_before_expert_parallelism": HONOURED,
    "comms_timeout_s": HONOURED,
    "comms_divergence_check": HONOURED,
    "zero_force_ds_cpu_optimizer": _no_op("with optimizer offload hf_zero always runs its own CPU Adam (a client "
                                          "Adam/AdamW is re-applied as it; other optimizers are refused)"),
    "communication_data_type": _refused(
        _REDUCE_DTYPE, active=lambda cfg: cfg.communication_data_type not in (None, _reduce_dtype(cfg))),
    # DeepSpeed makes it the communication_data_type when sequence_parallel_size > 1, and ignores it otherwise
    "seq_parallel_communication_data_type": _refused(
        _REDUCE_DTYPE, active=lambda cfg: (cfg.sequence_parallel_size or 1) > 1
        and cfg.seq_parallel_communication_data_type not in (None, _reduce_dtype(cfg))),
    "data_parallel_size": HONOURED,  # must equal the world size (checked by the loader)
    "sequence_parallel_size": HONOURED,  # Ulysses groups and batch arithmetic (hf_zero/sequence_parallel/setup.py)
    "torch_autocast.enabled": HONOURED,
    "torch_autocast.dtype": HONOURED,
    "torch_autocast.lower_precision_safe_modules": _todo(
        "gradients of every parameter are reduced in fp32 (the parameters' dtype), as without the list",
        # with bf16 / fp16 enabled the parameters, and so their gradients, are 16-bit already
        active=lambda cfg: cfg.torch_autocast.enabled and cfg.fp16.enabled is not True
        and cfg.bf16.enabled is not True),
    "fp16.enabled": HONOURED,
    "fp16.auto_cast": HONOURED,  # positional forward inputs cast to float16 (hf_zero/runtime/input_cast.py)
    "fp16.loss_scale": HONOURED,
    "fp16.initial_scale_power": HONOURED,
    "fp16.loss_scale_window": HONOURED,
    "fp16.hysteresis": HONOURED,
    "fp16.consecutive_hysteresis": HONOURED,
    "fp16.min_loss_scale": HONOURED,
    "fp16.fp16_master_weights_and_grads": _refused("hf_zero keeps fp32 master weights and gradients; remove it"),
    "bf16.enabled": HONOURED,
    "bf16.immediate_grad_update": _todo("gradients accumulate in data_types.grad_accum_dtype (default: the training "
                                        "dtype) and are added to the fp32 master weights at the step"),
    "bf16.check_grad_overflow": HONOURED,
    "bf16.bf16_master_weights_and_grads": HONOURED,
    "bf16.bf16_optimizer_states": HONOURED,
    "amp": _todo("NVIDIA apex AMP is not run; use fp16 or bf16", active=_switched_on("amp")),
    # DeepSpeed 0.19.8 removed its 1-bit optimizers ("OneBitAdam is not a supported DeepSpeed Optimizer"); the
    # configs written for older versions (DeepSpeedExamples' BingBert ones) still train here, uncompressed
    "optimizer.type": _todo("1-bit communication compression is not run: it trains as the uncompressed optimizer "
                            "(DeepSpeed 0.19.8 removed its 1-bit optimizers and refuses the type)",
                            active=_one_bit, label=_optimizer_label),
    "optimizer.params": HONOURED,
    "optimizer.torch_adam": _no_op("DeepSpeed reads torch_adam only inside optimizer.params and ignores it here",
                                   active=_optimizer_key_given("torch_adam")),
    "optimizer.adam_w_mode": _no_op("DeepSpeed reads adam_w_mode only inside optimizer.params and ignores it here",
                                    active=_optimizer_key_given("adam_w_mode")),
    "optimizer.legacy_fusion": _no_op("hf_zero has one fp16 optimizer path (DeepSpeed's legacy fused one is not "
                                      "separate)", active=_optimizer_key_given("legacy_fusion")),
    "scheduler.type": HONOURED,
    "scheduler.params": HONOURED,
    "zero_optimization.stage": HONOURED,
    "zero_optimization.contiguous_gradients": _no_op("gradients are always reduced from contiguous bucket buffers"),
    "zero_optimization.reduce_scatter": _no_op("stages 1-3 always reduce-scatter gradients, stage 0 all-reduces them "
                                               "(same averaged values)"),
    "zero_optimization.reduce_bucket_size": HONOURED,
    "zero_optimization.use_multi_rank_bucket_allreduce": _no_op("buckets are reduced one collective each (same "
                                                                "values)"),
    "zero_optimization.allgather_partitions": _no_op("updated partitions are always all-gathered (same values as "
                                                     "the broadcasts false selects)"),
    "zero_optimization.allgather_bucket_size": HONOURED,
    "zero_optimization.overlap_comm": HONOURED,
    "zero_optimization.load_from_fp32_weights": _refused(
        "hf_zero always restores the fp32 master weights saved in the checkpoint; remove load_from_fp32_weights"),
    "zero_optimization.elastic_checkpoint": _no_op("hf_zero checkpoints always load at any world size"),
    "zero_optimization.offload_optimizer.device": HONOURED,
    "zero_optimization.offload_optimizer.nvme_path": HONOURED,
    "zero_optimization.offload_optimizer.pin_memory": HONOURED,
    "zero_optimization.offload_optimizer.buffer_count": _no_op(_OFFLOAD_POOL),
    "zero_optimization.offload_optimizer.buffer_size": _no_op(_OFFLOAD_POOL),
    "zero_optimization.offload_optimizer.max_in_cpu": _no_op("applies to parameter offload only"),
    "zero_optimization.offload_optimizer.fast_init": _no_op("swap files are preallocated at start-up either way"),
    "zero_optimization.offload_optimizer.pipeline_read": _no_op(_PIPELINED),
    "zero_optimization.offload_optimizer.pipeline_write": _no_op(_PIPELINED),
    "zero_optimization.offload_optimizer.ratio": HONOURED,
    "zero_optimization.offload_param.device": HONOURED,
    "zero_optimization.offload_param.nvme_path": HONOURED,
    # training on a GPU: the host shards' flat buffers are page-locked (zero/stage3_groups.py); CPU training has
    # no device to transfer to, and zero.Init(pin_memory=True) pins its own partitions either way
    "zero_optimization.offload_param.pin_memory": HONOURED,
    "zero_optimization.offload_param.buffer_count": _no_op(_OFFLOAD_POOL),
    "zero_optimization.offload_param.buffer_size": _no_op(_OFFLOAD_POOL),
    "zero_optimization.offload_param.max_in_cpu": _todo("with offload_param nvme every partition that is not "
                                                        "persistent lives on the drive; none is kept in CPU memory"),
    "zero_optimization.offload_param.fast_init": _no_op("swap files are preallocated at start-up either way"),
    "zero_optimization.offload_param.pipeline_read": _no_op("partitions are read ahead along the recorded module "
                                                            "order always"),
    "zero_optimization.offload_param.pipeline_write": _no_op("partition writes always overlap the optimizer step"),
    "zero_optimization.offload_param.ratio": HONOURED,  # must be 1 (checked by the schema)
    "zero_optimization.sub_group_size": HONOURED,
    # ZenFlow (hf_zero/zero/zenflow.py, docs/zenflow.md); its config refuses update_interval 'auto' with an error
    # naming the key
    "zero_optimization.zenflow.topk_ratio": HONOURED,
    "zero_optimization.zenflow.select_strategy": HONOURED,
    "zero_optimization.zenflow.select_interval": HONOURED,
    "zero_optimization.zenflow.update_interval": HONOURED,
    "zero_optimization.zenflow.full_warm_up_rounds": HONOURED,
    "zero_optimization.zenflow.offload": HONOURED,  # the selective moments wait in CPU memory (same values)
    # DeepSpeed's one-window-late update and alternating moments, computed in order (docs/zenflow.md)
    "zero_optimization.zenflow.overlap_step": HONOURED,
    "zero_optimization.zenflow.auto_ratio": _no_op("it tunes update_interval 'auto', which hf_zero refuses",
                                                   active=_zenflow_set("auto_ratio", 0.99)),
    "zero_optimization.zenflow.pt_reserved_cores_perc": _no_op(
        "it splits cores with DeepSpeed's overlap_step optimizer process; hf_zero has none",
        active=_zenflow_set("pt_reserved_cores_perc", 0.5)),
    "zero_optimization.cpu_offload": HONOURED,
    "zero_optimization.cpu_offload_param": HONOURED,
    "zero_optimization.cpu_offload_use_pin_memory": HONOURED,
    "zero_optimization.stage3_prefetch_bucket_size": HONOURED,
    "zero_optimization.stage3_param_persistence_threshold": HONOURED,
    # hf_zero/config/policies.py:persistent_parameters, used by the ZeRO-3 runtime and the memory estimator
    "zero_optimization.stage3_model_persistence_threshold": HONOURED,
    "zero_optimization.stage3_max_live_parameters": HONOURED,
    "zero_optimization.stage3_max_reuse_distance": HONOURED,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": HONOURED,
    "zero_optimization.stage3_divergence_timeout_s": HONOURED,
    # modules at or under it become leaves, chosen by DeepSpeed's measure (hf_zero/zero/leaf.py)
    "zero_optimization.stage3_module_granularity_threshold": HONOURED,
    # stage 3 makes the matching modules leaves (hf_zero/zero/stage3_groups.py); stages 0-2 gather nothing, on
    # DeepSpeed too
    "zero_optimization.leaf_module.classes": HONOURED,
    "zero_optimization.leaf_module.names": HONOURED,
    "zero_optimization.leaf_module.name_suffixes": HONOURED,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _todo("parameters are fetched with all-gather "
                                                                      "(same values)"),
    "zero_optimization.stage3_allgather_sequential": _todo("parameters are all-gathered in buckets (same values)"),
    # honoured where DeepSpeed checks it (ZeroConfig.checks_unused_parameters), "no effect" elsewhere
    "zero_optimization.ignore_unused_parameters": _no_op(
        "DeepSpeed checks for parameters without a gradient only with offload_optimizer at stages 1-2",
        active=lambda cfg: cfg.zero.ignore_unused_parameters is False and not cfg.zero.checks_unused_parameters),
    "zero_optimization.legacy_stage1": _no_op("hf_zero has one stage-1 implementation"),
    "zero_optimization.compute_grad_norm": HONOURED,  # zero/optimizer.py: no norm reduction when false
    "zero_optimization.parameter_alignment": _no_op("hf_zero keeps each parameter's shard on its own, not in "
                                                    "DeepSpeed's flat buffer whose parameter starts the option "
                                                    "aligns; the results are the same"),
    "zero_optimization.pipeline_loading_checkpoint": _no_op(
        "the local ranks load their checkpoint shards at the same time (same values; DeepSpeed serialises them to "
        "bound host memory at load)"),
    "zero_optimization.round_robin_gradients": _no_op("gradient copies to the CPU are not spread over ranks (same "
                                                      "values)"),
    # A secondary group (hpZ) or shard group (MiCS) as large as the data-parallel world is the primary partition
    # itself -- what a one-node config usually asks (zero_hpz_partition_size = GPUs per node): hf_zero's one
    # partition over the world is then DeepSpeed's, values and layout (DeepSpeed also keeps the secondary copy).
    "zero_optimization.zero_hpz_partition_size": _todo(
        "parameters are partitioned over the whole data-parallel group",
        active=lambda cfg: cfg.zero.zero_hpz_partition_size not in (1, cfg.world_size)),
    "zero_optimization.zero_quantized_weights": _todo("weights are all-gathered unquantized"),
    "zero_optimization.zero_quantized_nontrainable_weights": _todo("frozen weights are stored unquantized"),
    "zero_optimization.zero_quantized_gradients": _todo("gradients are reduced unquantized"),
    # DeepSpeed 0.19.8 removed MiCS and refuses both keys (DeepSpeedConfigError); hf_zero trains such a config
    # with its one partition, and says so
    "zero_optimization.mics_shard_size": _todo("parameters are partitioned over the whole data-parallel group "
                                               "(DeepSpeed 0.19.8 removed MiCS and refuses the key)",
                                               active=lambda cfg: cfg.zero.mics_shard_size not in (-1, 0,
                                                                                                  cfg.world_size)),
    "zero_optimization.mics_hierarchical_params_gather": _todo("parameters are all-gathered in one level "
                                                               "(DeepSpeed 0.19.8 removed MiCS and refuses the key)"),
    "zero_optimization.memory_efficient_linear": _no_op("hf_zero's linear layers are torch's"),
    # read by zero.Init (hf_zero/zero/init.py): modules built inside gather their parameters in apply(fn)
    "zero_optimization.override_module_apply": HONOURED,
    # a warning naming the module that asked for its parameters out of the recorded order (zero/stage3/prefetch.py)
    "zero_optimization.log_trace_cache_warnings": HONOURED,
    # keeps comms_divergence_check on (hf_zero/comm/faults.py:configure_from): every collective compares what the
    # ranks issue, which covers DeepSpeed's stage-3 sanity checks (ranks' parameter ids before gathers/reductions)
    "zero_optimization.enable_sanity_checks": HONOURED,
    "aio.block_size": HONOURED,
    "aio.queue_depth": HONOURED,
    "aio.intra_op_parallelism": HONOURED,
    "aio.single_submit": HONOURED,
    "aio.overlap_events": _no_op("submission and completion always overlap (background I/O threads)"),
    "aio.use_gds": _todo("NVMe transfers go through host memory"),
    # Applied by deepspeed.checkpointing.configure(deepspeed_config=...) (hf_zero/runtime/activation_checkpointing.py)
    # to the regions a script checkpoints with deepspeed.checkpointing.checkpoint -- as in DeepSpeed 0.19.8, whose
    # engine parses this section but never reads it. Models checkpointed with gradient_checkpointing_enable() use
    # torch.utils.checkpoint and do not see it, in DeepSpeed either.
    "activation_checkpointing.partition_activations": HONOURED,
    "activation_checkpointing.cpu_checkpointing": HONOURED,
    "activation_checkpointing.synchronize_checkpoint_boundary": HONOURED,
    "activation_checkpointing.profile": HONOURED,
    "activation_checkpointing.contiguous_memory_optimization": _todo(
        "checkpoint partitions are kept as separate tensors, not copied into one preallocated buffer (same values)"),
    "activation_checkpointing.number_checkpoints": _no_op(
        "it only sizes DeepSpeed's contiguous checkpoint buffer, which hf_zero does not build "
        "(activation_checkpointing.contiguous_memory_optimization)"),
    "flops_profiler": HONOURED,  # hf_zero/profiling/step_profile.py
    # the engine's monitor writes DeepSpeed's events to them on global rank 0 (hf_zero/runtime/monitor.py)
    "tensorboard": HONOURED,
    "csv_monitor": HONOURED,
    "wandb": HONOURED,
    "comet": HONOURED,
    "comms_logger": HONOURED,  # hf_zero/comm/comms_log.py: hf_zero's and deepspeed.comm's collectives are recorded
    # reliability (#14) owns checkpoint behaviour.
    "checkpoint.tag_validation": HONOURED,  # hf_zero/checkpoint/tags.py
    # tags named by latest_universal, read by hf_zero/checkpoint/deepspeed_format.py (a universal tag loads without
    # it too; with it, a tag that is not universal is refused naming the key)
    "checkpoint.load_universal": HONOURED,
    "checkpoint.use_node_local_storage": HONOURED,  # hf_zero/checkpoint/placement.py
    "checkpoint.parallel_write": _no_op("every rank always writes its own files in parallel"),
    "data_types.grad_accum_dtype": HONOURED,
    "data_types.param_dtype": HONOURED,  # checked against the precision mode (hf_zero_config.py)
    "data_types.buffer_dtype": HONOURED,  # hf_zero/zero/buffer_dtypes.py, applied by the engine
    "data_types.keep_in_fp32_modules": HONOURED,  # hf_zero/zero/buffer_dtypes.py (zero.Init and the engine)
    # pipeline (#17) owns this section.
    # its keys are checked by hf_zero.pipeline.config; initialize() refuses the section for a non-pipeline model
    "pipeline": HONOURED,
    "compression_training": _todo("the engine does not apply it; hf_zero.compression.init_compression(model, config) "
                                  "or the HF CompressionCallback does", active=_switched_on("compression_training")),
    # tensor_parallel (#18) owns this section.
    "tensor_parallel": HONOURED,  # parsed and checked key by key in hf_zero/tensor_parallel/config.py
    # the elastic plan sets the three batch keys for the world size (hf_zero/config/elasticity.py, via load_config)
    "elasticity": HONOURED,
    "autotuning": _todo("nothing is tuned", active=_switched_on("autotuning")),
    "expert_parallel": _todo("the model's MoE blocks are not converted: every rank holds every expert (the same "
                             "results, more memory); for expert parallelism build the blocks with "
                             "deepspeed.moe.layer.MoE(ep_size=...) (hf_zero.moe)",
                             active=_switched_on("expert_parallel")),
    # dynamic batching (data_sampling.dynamic_batching) is honoured by the data loader a script builds with
    # get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed (runtime/variable_batch.py)
    # data_sampling.dynamic_batching: runtime/variable_batch.py; data_routing.random_ltd: runtime/random_ltd.py
    "data_efficiency": _todo("its curriculum data sampling is not run (data_sampling.dynamic_batching and "
                             "data_routing.random_ltd are)", active=_data_efficiency_beyond_batching),
    "progressive_layer_drop": HONOURED,  # the model's forward gets the keep probability (hf_zero/runtime/pld.py)
    "curriculum_learning": HONOURED,  # DeepSpeed's legacy curriculum (hf_zero/runtime/curriculum.py)
    # hf_zero/runtime/hybrid_engine.py. DeepSpeed also swaps in its inference kernels for the model families it has
    # policies for; the other keys size or tune those kernels. hf_zero generates with the model's own forward (so
    # does DeepSpeed for a model without a policy, e.g. OPT with transformers >= 4.56).
    "hybrid_engine.enabled": HONOURED,
    "hybrid_engine.pin_parameters": HONOURED,
    "hybrid_engine.max_out_tokens": _no_op(
        "it sizes DeepSpeed's inference-kernel workspace; hf_zero generates with the model's own forward, which "
        "needs none", active=_hybrid_set("max_out_tokens")),
    "hybrid_engine.release_inference_cache": _no_op(
        "hf_zero keeps no inference workspace between generate() calls: what it gathers for one is released when "
        "it returns", active=_hybrid_set("release_inference_cache")),
    "hybrid_engine.inference_tp_size": _todo(
        "each rank generates its own batch with the whole model gathered (the same tokens, no tensor-parallel "
        "split of the generation)", active=_hybrid_set("inference_tp_size")),
    "hybrid_engine.tp_gather_partition_size": _no_op(
        "it groups layers for inference_tp_size > 1, which hf_zero does not split",
        active=_hybrid_set("tp_gather_partition_size")),
    "hybrid_engine.enable_cuda_graph": _todo("decoding steps run eagerly (DeepSpeed captures graphs only for its "
                                             "injected kernels, never at ZeRO-3)",
                                             active=_hybrid_set("enable_cuda_graph")),
}


def _get(cfg: Any, path: str) -> Any:
    from .schema import json_fields, json_key

    node = cfg
    for part in path.split("."):
        by_key = {json_key(f): f.name for f in json_fields(type(node))}
        node = getattr(node, by_key[part])
    return node


def _is_set(cfg: "HfZeroConfig", path: str, entry: KeyStatus, default: "HfZeroConfig") -> bool:
    if entry.active is not None:
        return entry.active(cfg)
    return _get(cfg, path) != _get(default, path)


def not_honoured(cfg: "HfZeroConfig") -> list[tuple[str, KeyStatus]]:
    """(label, status) of every key ``cfg`` sets that hf_zero does not honour, in table order."""
    from .hf_zero_config import HfZeroConfig

    default = HfZeroConfig()
    out = []
    for path, entry in STATUS.items():
        if entry.status is not Status.HONOURED and _is_set(cfg, path, entry, default):
            out.append((entry.label(cfg) if entry.label else path, entry))
    return out


def enforce(cfg: "HfZeroConfig", *, warn: bool) -> tuple[str, ...]:
    """Raise for a refused key that is set; warn (when ``warn``) once per key that is set and not honoured.
    Returns the labels of the set keys that are not implemented, for the start-up table."""
    found = not_honoured(cfg)
    for label, entry in found:
        if entry.status is Status.REFUSED:
            raise ConfigError(label, f"{_get(cfg, label)!r} is not supported: {entry.note}")
    if warn:
        for label, entry in found:
            what = "has no effect in hf_zero" if entry.status is Status.NO_OP else "is not implemented in hf_zero"
            warnings.warn(f"hf_zero: config key {label} {what}: {entry.note}", ConfigKeyIgnored, stacklevel=3)
    return tuple(label for label, entry in found if entry.status is Status.NOT_IMPLEMENTED)
