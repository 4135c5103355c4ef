"""``deepspeed.DeepSpeedConfig`` / ``deepspeed.runtime.config.DeepSpeedConfig`` over hf_zero's config parsing.

DeepSpeed's class takes a config (dict, JSON path or base64 JSON), resolves the batch sizes for the data-parallel
world and exposes the result as attributes that scripts read (``train_batch_size``, ``zero_optimization_stage``,
``float16_config.enabled``, ``optimizer_name``, ...). Here the config goes through :func:`hf_zero.config.load_config`
-- the same validation, ``auto`` handling and key-status warnings as ``hf_zero.initialize`` -- and the attributes
are read off the resulting :class:`~hf_zero.config.HfZeroConfig` (kept as ``hf_zero_config``). Values are
hf_zero's resolved ones (e.g. ``steps_per_print`` defaults to 10 here). Typed sections are hf_zero's frozen
dataclasses: ``zero_config.stage``, ``float16_config.loss_scale``, ``bfloat16_config.enabled``, ... keep DeepSpeed's
field names.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from hf_zero.config import load_config, read_config
from hf_zero.config.schema import Auto

__all__ = ["DeepSpeedConfig"]

# optimizer names DeepSpeed lowercases (its DEEPSPEED_OPTIMIZERS); other names keep the user's spelling
_DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")


def _world(config: dict[str, Any], mpu) -> tuple[int, int]:
    """(rank, data-parallel world size) as DeepSpeed's config sees them; (0, 1) without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return dist.get_rank(), mpu.get_data_parallel_world_size()
        return dist.get_rank(), dist.get_world_size() // mpu.get_sequence_parallel_world_size()
    return dist.get_rank(), dist.get_world_size() // int(config.get("sequence_parallel_size") or 1)


def _plain(value: Any) -> Any:
    return None if isinstance(value, Auto) else value


class DeepSpeedConfig:
    """A DeepSpeed config resolved for this run's data-parallel world. ``DeepSpeedConfig(config, mpu=None)``."""

    def __init__(self, config, mpu=None, mesh_device=None):
        if mesh_device is not None:
            raise NotImplementedError("DeepSpeedConfig(mesh_device=...): hf_zero builds its own device mesh "
                                      "(hf_zero.parallel); pass mpu= or nothing")
        self._param_dict = read_config(config)
        self.global_rank, self.world_size = _world(self._param_dict, mpu)
        cfg = load_config(copy.deepcopy(self._param_dict), world_size=self.world_size, rank=self.global_rank,
                          log=False, unresolved_auto="default")
        self.hf_zero_config = cfg

        self.train_batch_size = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.managed_gradient_accumulation = cfg.managed_gradient_accumulation  # DeepSpeed 0.19's newer keys
        self.gradient_allreduce_op = cfg.gradient_allreduce_op.lower()
        self.log_level = cfg.log_level
        self.disable_python_gc = cfg.disable_python_gc
        self.steps_per_print = cfg.steps_per_print
        self.dump_state = cfg.dump_state
        self.gradient_clipping = _plain(cfg.gradient_clipping)
        self.prescale_gradients = cfg.prescale_gradients
        self.gradient_predivide_factor = cfg.gradient_predivide_factor
        self.communication_data_type = cfg.communication_data_type
        self.sparse_gradients_enabled = cfg.sparse_gradients
        self.zero_allow_untested_optimizer = cfg.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = cfg.zero_force_ds_cpu_optimizer

        self.zero_config = cfg.zero
        self.zero_optimization_stage = _plain(cfg.zero.stage) or 0
        self.zero_enabled = self.zero_optimization_stage > 0

        self.float16_config = cfg.fp16
        self.bfloat16_config = cfg.bf16
        self.torch_autocast_enabled = cfg.torch_autocast.enabled

        self.optimizer_name = None if cfg.optimizer is None else cfg.optimizer.type
        if self.optimizer_name is not None and self.optimizer_name.lower() in _DEEPSPEED_OPTIMIZERS:
            self.optimizer_name = self.optimizer_name.lower()
        self.optimizer_params = None if cfg.optimizer is None else dict(cfg.optimizer.params)
        self.scheduler_name = None if cfg.scheduler is None else cfg.scheduler.type
        self.scheduler_params = None if cfg.scheduler is None else dict(cfg.scheduler.params)

        self.flops_profiler_config = cfg.flops_profiler
        self.wall_clock_breakdown = cfg.wall_clock_breakdown or cfg.flops_profiler.enabled
        self.memory_breakdown = cfg.memory_breakdown
        self.activation_checkpointing_config = cfg.activation_checkpointing
        self.aio_config = cfg.aio
        self.checkpoint_config = cfg.checkpoint
        self.checkpoint_tag_validation_enabled = cfg.checkpoint.tag_validation != "ignore"
        self.checkpoint_tag_validation_fail = cfg.checkpoint.tag_validation == "fail"
        self.load_universal_checkpoint = cfg.checkpoint.load_universal
        self.use_node_local_storage = _plain(cfg.checkpoint.use_node_local_storage)
        self.grad_accum_dtype = cfg.data_types.grad_accum_dtype
        self.param_dtype = cfg.data_types.param_dtype
        self.pipeline = dict(cfg.pipeline or {})
        # DeepSpeed's comms-logger switch, read by deepspeed.comm.configure(deepspeed_config=...)
        self.comms_config = SimpleNamespace(comms_logger_enabled=cfg.comms_logger.enabled,
                                            comms_logger=cfg.comms_logger)
        # the monitor sections, read by deepspeed.monitor.monitor.MonitorMaster
        self.monitor_config = SimpleNamespace(tensorboard=cfg.tensorboard, csv_monitor=cfg.csv_monitor,
                                              wandb=cfg.wandb, comet=cfg.comet)

    # DeepSpeed < 0.16 kept these as plain attributes; older scripts still read them.
    @property
    def fp16_enabled(self) -> bool:
        return self.float16_config.enabled is True

    @property
    def bfloat16_enabled(self) -> bool:
        return self.bfloat16_config.enabled is True

    @property
    def fp16_auto_cast(self) -> bool:
        return self.float16_config.auto_cast

    @property
    def loss_scale(self) -> float:
        return self.float16_config.loss_scale

    @property
    def initial_dynamic_scale(self) -> float:
        return 2.0**self.float16_config.initial_scale_power

    @property
    def config(self) -> dict[str, Any]:
        """The resolved JSON dict (what ``engine.config`` returns)."""
        return dict(self.hf_zero_config.raw)

    def print(self, name: str) -> None:
        print(f"{name}:")
        for key, value in sorted(vars(self).items()):
            if key not in ("_param_dict", "hf_zero_config"):
                print(f"  {key} {'.' * max(1, 29 - len(key))} {value}")

    def __repr__(self) -> str:
        return (f"DeepSpeedConfig(train_batch_size={self.train_batch_size}, micro={self.train_micro_batch_size_per_gpu}"
                f", gas={self.gradient_accumulation_steps}, zero_stage={self.zero_optimization_stage}, "
                f"world_size={self.world_size})")
