"""DeepSpeed's engine getters for the ZeRO section, precision and data settings, and the run's ranks.

DeepSpeed's ``DeepSpeedEngine`` answers every config key through a method (``engine.zero_sub_group_size()``,
``engine.dynamic_loss_scale_args()``, ``engine.get_data_parallel_rank()``); scripts and libraries written for it
read them. Each answers here as DeepSpeed 0.19.8 does for the same config, from the typed config the engine was
built from (hf_zero spells the stage-3 keys with their ``stage3_`` prefix; DeepSpeed's getters drop it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hf_zero.comm import sequence_groups
from hf_zero.config.boolean import truthy
from hf_zero.tensor_parallel import tp_info

__all__ = ["DeepSpeedConfigGetters"]

# DeepSpeed's getter -> hf_zero's ZeroConfig field (the same value; DeepSpeed's field names lack "stage3_")
_ZERO_FIELDS = {
    "zero_allgather_partitions": "allgather_partitions",
    "zero_allgather_sequential": "stage3_allgather_sequential",
    "zero_compute_grad_norm": "compute_grad_norm",
    "zero_elastic_checkpoint": "elastic_checkpoint",
    "zero_hpz_partition_size": "zero_hpz_partition_size",
    "zero_ignore_unused_parameters": "ignore_unused_parameters",
    "zero_legacy_stage1": "legacy_stage1",
    "zero_load_from_fp32_weights": "load_from_fp32_weights",
    "zero_log_trace_cache_warnings": "log_trace_cache_warnings",
    "zero_max_live_parameters": "stage3_max_live_parameters",
    "zero_max_reuse_distance": "stage3_max_reuse_distance",
    "zero_model_persistence_threshold": "stage3_model_persistence_threshold",
    "zero_module_granularity_threshold": "stage3_module_granularity_threshold",
    "zero_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce",
    "zero_param_persistence_threshold": "stage3_param_persistence_threshold",
    "zero_parameter_alignment": "parameter_alignment",
    "zero_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "zero_quantized_gradients": "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights": "zero_quantized_nontrainable_weights",
    "zero_quantized_weights": "zero_quantized_weights",
    "zero_round_robin_gradients": "round_robin_gradients",
    "zero_sub_group_size": "sub_group_size",
    "is_sanity_checks_enabled": "enable_sanity_checks",
    "zenflow_config": "zenflow",
}

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _zero_getter(getter: str, field: str):
    def get(self) -> Any:
        return getattr(self._config.zero, field)

    get.__name__ = get.__qualname__ = getter
    get.__doc__ = f"DeepSpeed's ``engine.{getter}()``: ``zero_optimization.{field}``."
    return get


class DeepSpeedConfigGetters:
    """Mixed into the engine (through DeepSpeedEngineAPI); reads ``_config``, the groups and the module."""

    # ---- ZeRO --------------------------------------------------------------------------------------------------------
    def zero_optimization_partition_gradients(self) -> bool:
        return int(self._config.zero.stage) >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return int(self._config.zero.stage) >= 3

    def zero_use_cpu_optimizer(self) -> bool:
        """The optimizer steps on the host: ``offload_optimizer.device`` cpu or nvme."""
        return self._config.zero.offload_optimizer.device in ("cpu", "nvme")

    def zero_nvme_offload_optimizer(self) -> bool:
        return self._config.zero.offload_optimizer.device == "nvme"

    def zero_partial_offload(self) -> float:
        return float(self._config.zero.offload_optimizer.ratio)

    def zero_allow_untested_optimizer(self) -> bool:
        return bool(self._config.zero_allow_untested_optimizer)

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return bool(self._config.zero_force_ds_cpu_optimizer)

    # ---- precision ---------------------------------------------------------------------------------------------------
    def dynamic_loss_scale(self) -> bool:
        """fp16's loss scale adapts (``fp16.loss_scale`` 0), as DeepSpeed answers whether or not fp16 is on."""
        return float(self._config.fp16.loss_scale) == 0

    def initial_dynamic_scale(self) -> float:
        return 2 ** int(self._config.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict:
        """DeepSpeed's dict for its dynamic loss scaler (its key names)."""
        fp16 = self._config.fp16
        return {"init_scale": 2 ** int(fp16.initial_scale_power), "scale_window": int(fp16.loss_scale_window),
                "delayed_shift": int(fp16.hysteresis), "consecutive_hysteresis": bool(fp16.consecutive_hysteresis),
                "min_scale": float(fp16.min_loss_scale)}

    def fp16_master_weights_and_gradients(self) -> bool:
        return bool(self._config.fp16.fp16_master_weights_and_grads)

    def bf16_master_weights_and_gradients(self) -> bool:
        return bool(self._config.bf16.bf16_master_weights_and_grads)

    def bf16_optimizer_states(self) -> bool:
        return bool(self._config.bf16.bf16_optimizer_states)

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's compute dtype, the gradient accumulation dtype) -- ``data_types.grad_accum_dtype``, or the
        compute dtype when unset."""
        model = self._config.compute_dtype
        grad = self._config.data_types.grad_accum_dtype
        return model, (_DTYPES[grad] if grad is not None else model)

    def torch_autocast_lower_precision_safe_modules(self):
        return self._config.torch_autocast.lower_precision_safe_modules

    def optimizer_legacy_fusion(self) -> bool:
        optimizer = self._config.optimizer
        return bool(optimizer.legacy_fusion) if optimizer is not None and optimizer.legacy_fusion is not None \
            else False

    # ---- data --------------------------------------------------------------------------------------------------------
    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def dataloader_drop_last(self) -> bool:
        return bool(self._config.dataloader_drop_last)

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint.tag_validation != "ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint.tag_validation == "fail"

    def data_efficiency_config(self) -> dict:
        return dict(self._config.data_efficiency or {})

    def data_efficiency_enabled(self) -> bool:
        return truthy(self.data_efficiency_config().get("enabled"))

    def data_sampling_config(self) -> dict:
        return dict(self.data_efficiency_config().get("data_sampling") or {})

    def data_sampling_enabled(self) -> bool:
        return truthy(self.data_sampling_config().get("enabled"))

    def curriculum_learning_config(self) -> dict:
        """``data_efficiency.data_sampling.curriculum_learning`` (the legacy top-level section is
        ``curriculum_params_legacy()``, as in DeepSpeed)."""
        return dict(self.data_sampling_config().get("curriculum_learning") or {})

    def curriculum_learning_enabled(self) -> bool:
        return truthy(self.curriculum_learning_config().get("enabled"))

    def aio_config(self) -> dict:
        """The ``aio`` section with its defaults, as DeepSpeed's dict (``thread_count`` is
        ``intra_op_parallelism``)."""
        return dataclasses.asdict(self._config.aio)

    def autotp_size(self) -> int:
        """The tensor-parallel degree (1 without tensor parallelism)."""
        info = tp_info(self.module)
        return info.mesh.size() if info is not None else 1

    @staticmethod
    def is_map_style_dataset(obj) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    # ---- the run's ranks ---------------------------------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self.process_group) if torch.distributed.is_initialized() else 0

    def get_model_parallel_rank(self) -> int:
        group = self.model_parallel_group
        return torch.distributed.get_rank(group) if group is not None else 0

    def get_tensor_parallel_rank(self) -> int:
        info = tp_info(self.module)
        return info.mesh.get_local_rank() if info is not None else 0

    def get_sequence_parallel_group(self):
        """The Ulysses group this rank is in; None without sequence parallelism (DeepSpeed's attribute then)."""
        if not sequence_groups.sequence_parallel_is_initialized():
            return None
        return sequence_groups.get_sequence_parallel_group() if sequence_groups.get_sequence_parallel_world_size() > 1 \
            else None


for _getter, _field in _ZERO_FIELDS.items():
    setattr(DeepSpeedConfigGetters, _getter, _zero_getter(_getter, _field))
