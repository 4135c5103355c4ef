"""The training engine behind ``hf_zero.initialize``: DeepSpeed's engine API over ZeRO stages 0-3.

    engine, optimizer, _, scheduler = hf_zero.initialize(model=model, config="ds_config.json")
    for batch in data:
        loss = engine(batch)            # forward
        engine.backward(loss)           # scaled backward; gradients reduced into shards as they appear
        engine.step()                   # optimizer + scheduler, only at the gradient-accumulation boundary

The boundary is every ``gradient_accumulation_steps``-th micro-step (or where ``set_gradient_accumulation_boundary``
puts it); with ``managed_gradient_accumulation: false`` every ``step()`` is one, after any number of backwards.

The engine owns *when* things happen (micro-steps, boundaries, loss scaling, logging, checkpoints); the ZeRO
objects own *how* state is sharded: :class:`ShardedGroup` (the shards), :class:`GroupGradReducer` (stages 0-2
gradient hooks), the stage-3 runtime (parameter gather/release), :class:`ZeroOptimizer` (the update).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, ClassVar, Iterable

import torch
from torch import nn

from hf_zero import comm
from hf_zero.config import HfZeroConfig, loss_scale_policy, precision_policy, zero_policy
from hf_zero.config.errors import ConfigAssertionError, ConfigError
from hf_zero.ops import host_cache
from hf_zero.profiling.memory_usage import see_memory_usage
from hf_zero.profiling.step_calibration import StepTimeCalibrator
from hf_zero.profiling.step_profile import StepProfiler
from hf_zero.profiling.throughput_timer import ThroughputTimer
from hf_zero.profiling.timers import PhaseTimers, TotalingTimers
from hf_zero.runtime.backward import BackwardSessions
from hf_zero.runtime.curriculum import CurriculumScheduler
from hf_zero.runtime.ds_engine_api import DeepSpeedEngineAPI
from hf_zero.runtime.errors import UsageError
from hf_zero.runtime.hybrid_engine import HybridGeneration
from hf_zero.runtime.input_cast import cast_inputs_half
from hf_zero.runtime.monitor import MonitorMaster, boundary_events
from hf_zero.runtime.optimizers import OptimizerPlan, adopt_client_groups
from hf_zero.runtime.pld import ProgressiveLayerDrop
from hf_zero.runtime.python_gc import python_gc
from hf_zero.tensor_parallel import tp_info
from hf_zero.zero.buffer_dtypes import cast_module_buffers, unusable_norms
from hf_zero.zero.grad_reducer import GroupGradReducer, ReduceMode
from hf_zero.zero.loss_scaler import LossScaler
from hf_zero.zero.optimizer import ZeroOptimizer
from hf_zero.zero.placement import place_module
from hf_zero.zero.local import local_tensor
from hf_zero.zero.sharded_group import ShardedGroup

__all__ = ["HfZeroEngine", "UnusedParametersError"]

logger = logging.getLogger("hf_zero")


class UnusedParametersError(RuntimeError, AssertionError):
    """Trainable parameters got no gradient with ``zero_optimization.ignore_unused_parameters: false``. Also an
    AssertionError: DeepSpeed asserts there, and scripts (DeepSpeed's own tests among them) catch that type."""


def _check_loss(loss: Any, call: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UsageError(f"hf_zero: engine.{call}(loss) needs a scalar tensor loss, got {got}; for a non-scalar "
                         f"output call output.backward(grad) on the engine's output (DeepSpeed asserts the same)")
    if not loss.requires_grad:
        raise UsageError(f"hf_zero: engine.{call}(loss) got a loss that does not require grad; was the forward run "
                         f"under torch.no_grad(), or are all parameters frozen?")


class HfZeroEngine(DeepSpeedEngineAPI, nn.Module):
    """A ``torch.nn.Module`` wrapping the user's model; see the module docstring for the loop."""

    # Refuse parameter gradients from backward passes the engine did not see (runtime/backward.py). An engine that
    # runs backward through its own schedule rather than engine.backward (PipelineEngine) turns this off.
    _guards_backward: ClassVar[bool] = True
    # wall_clock_breakdown's elapsed_time_ms events (runtime/monitor.py): DeepSpeed's pipeline engine writes none
    _monitors_phase_times: ClassVar[bool] = True
    # DeepSpeed's engine attribute: whether train_batch() drives the micro-batches (a PipelineModule's engine)
    pipeline_parallelism: ClassVar[bool] = False

    def __init__(self, module: nn.Module, config: HfZeroConfig, plan: OptimizerPlan | None,
                 lr_scheduler: Any = None, process_group=None, model_parallel_group=None):
        """``process_group``: the data-parallel group ZeRO shards over (None: the whole world); it need not contain
        global rank 0. ``model_parallel_group``: the ranks holding *other parts* of the same model replica
        (pipeline stages, tensor-parallel shards); the gradient norm used for clipping and the fp16 overflow
        decision are summed over it too, so every part clips by the unsplit model's norm."""
        super().__init__()
        self.module = module
        self._config = config
        self._mpu = None  # initialize(mpu=...) sets it: DeepSpeed keeps it as engine.mpu
        self.hybrid: HybridGeneration | None = None  # hybrid_engine.enabled: set by _finish_init
        self._inside_no_sync = False  # engine.no_sync(): backward passes reduce nothing
        self._coalescing = False  # engine.coalesce_grad_reduction(): passes hold gradients until the block ends
        self.process_group = process_group
        self.model_parallel_group = model_parallel_group
        self.world_size = comm.get_world_size(process_group)
        self.global_rank = comm.get_rank(process_group)
        # the schema translated once: zero/ and offload/ only ever see these policies
        self.zero_policy = zero_policy(config)
        precision = precision_policy(config)
        self.stage = self.zero_policy.stage
        self.compute_dtype = precision.compute_dtype
        # DeepSpeed's contract: the engine trains on cuda:LOCAL_RANK (or the CPU, see comm/device.py) wherever the
        # model was built, so it moves the module there before building anything from its parameters. ZeRO-3
        # parameters stay in host memory (or swap files) when offload_param says so; gathers bring them over.
        self._device = comm.local_device()
        place_module(module, self._device,
                     params_on_host=self.stage == 3 and self.zero_policy.offload_param is not None)
        self.timers = PhaseTimers(config.wall_clock_breakdown)
        self.monitor = MonitorMaster(config)  # tensorboard / csv_monitor / wandb / comet, written on global rank 0
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self._boundary_override: bool | None = None
        # managed_gradient_accumulation false: the caller's step() is the boundary; True only while it runs, and
        # the backward passes since the last step() (global_samples counts them, DeepSpeed's rule)
        self._managed_gas = bool(config.managed_gradient_accumulation)
        self._in_caller_step = False
        self._backwards_since_step = 0
        self._step_applied = False  # did the latest step() update the parameters (was_step_applied)
        self._gc_token: int | None = None  # disable_python_gc's hold, taken last in _finish_init
        self.zenflow = None  # zero_optimization.zenflow: set below once the optimizer exists (zero/zenflow.py)
        see_memory_usage("Engine before configure distributed model", force=self.memory_breakdown())
        # curriculum_learning (DeepSpeed's legacy one): each training forward moves it to step global_steps + 1
        self.curriculum_scheduler_legacy = (CurriculumScheduler(config.curriculum_learning)
                                            if config.curriculum_learning.enabled else None)
        # data_efficiency.data_routing.random_ltd: the schedule the layers a script wraps with
        # convert_to_random_ltd follow (runtime/random_ltd.py); each training forward moves it to global_steps
        from hf_zero.runtime.random_ltd import RandomLTDScheduler, random_ltd_policy

        ltd = random_ltd_policy(config.data_efficiency)
        self.random_ltd_scheduler = (RandomLTDScheduler(ltd, int(config.train_batch_size or 0))
                                     if ltd is not None else None)
        # progressive_layer_drop: each training forward gets the keep probability; each step moves it
        # (runtime/pld.py)
        self.progressive_layer_drop = (ProgressiveLayerDrop(config.progressive_layer_drop.theta,
                                                            config.progressive_layer_drop.gamma)
                                       if config.progressive_layer_drop.enabled else None)
        # torch_autocast: the forward runs under torch.autocast, parameters stay fp32; float16 gets loss scaling
        # with the fp16 section's settings (DeepSpeed uses a GradScaler there)
        self._autocast = config.torch_autocast if config.torch_autocast.enabled else None
        self._autocast_dtype = _autocast_dtype(self._autocast, self.device) if self._autocast else None
        fp16_scaling = config.fp16.enabled is True or self._autocast_dtype == torch.float16
        self.loss_scaler = LossScaler.from_policy(loss_scale_policy(config.fp16)) if fp16_scaling else None
        # every hf_zero collective from here on is bounded and checked (hf_zero/comm/faults.py)
        comm.faults.configure_from(config, process_group)
        comm.comms_log.configure_from(config.comms_logger)  # an enabled comms_logger section switches it on
        if self.device.type == "cpu":  # host memory is the training memory: keep glibc from hoarding freed tensors
            from hf_zero.zero.host_memory import tune_cpu_training_memory

            tune_cpu_training_memory(stage3=False)
        self._backward = BackwardSessions(
            begin=self._begin_backward, end=self._end_backward, gas=self.gradient_accumulation_steps,
            loss_scale=lambda: self.loss_scaler.scale if self.loss_scaler is not None else None,
            timers=lambda: self.timers)

        # offload sections the engine cannot honour are refused here, before the model is partitioned or cast
        from hf_zero.offload import check_offload_config

        fused_adam = plan.fused_adam if plan is not None else False
        check_offload_config(self.zero_policy, param_device=self.device, fused_adam=fused_adam,
                             torch_adam=plan is not None and plan.torch_adam)
        from hf_zero.runtime.preflight import check_nvme_paths

        check_nvme_paths(config, module, stage=self.stage, world_size=self.world_size, rank=self.global_rank,
                         group=process_group)
        self._cast_buffers(module, precision)
        names = {p: n for n, p in module.named_parameters(remove_duplicate=False)}
        grad_dtype = precision.grad_dtype
        self._master_dtype, self._state_dtype = _bf16_state_dtypes(config, self.stage, grad_dtype, plan)
        self.stage3 = None
        tp = tp_info(module)
        # MoE layers get their expert-parallel groups here, as DeepSpeed's engine gives them (runtime/moe_setup.py)
        from hf_zero.runtime.moe_setup import setup_expert_parallel

        self._expert_groups = setup_expert_parallel(module, stage=self.stage, process_group=process_group,
                                                    tensor_parallel=tp is not None,
                                                    pipeline=model_parallel_group is not None,
                                                    data_before_expert=config.use_data_before_expert_parallelism)
        if self.stage == 3:
            self.groups = self._init_stage3(plan, names, grad_dtype)
            if plan is None:
                self.stage3.grad_guard = self._no_optimizer
            elif self._guards_backward:
                self.stage3.grad_guard = self._backward.guard
            publisher = self.stage3.after_step
        else:
            self.groups = self._init_stages_0_to_2(plan, names, grad_dtype)
            publisher = None
        zero = self.zero_policy
        if plan is None:
            # An evaluation engine (initialize got no optimizer and the config has none, as DeepSpeed allows):
            # parameters placed as for training -- ZeRO-3 partitioned, gathered module by module in forward --
            # and no optimizer, gradient reduction or scheduler (DeepSpeed builds no scheduler without one either).
            self.optimizer = None
            self.reducer = None
            self.lr_scheduler = None
            self._finish_init(module, config)
            return
        # offload_optimizer (hf_zero/offload): moves each group's master and Adam moments to CPU memory / NVMe
        from hf_zero.offload import build_optimizer_offload

        offload = build_optimizer_offload(self.groups, zero, rank=self.global_rank,
                                          fused_adam=plan.fused_adam, torch_adam=plan.torch_adam,
                                          state_dtype=self._state_dtype)
        self.optimizer = ZeroOptimizer(
            self.groups, [h for _, h in plan.groups], param_group_of=getattr(self, "_param_group_of", None),
            inner_cls=plan.inner_cls, inner_defaults=plan.defaults,
            fused_adam=plan.fused_adam, loss_scaler=self.loss_scaler, clip_norm=float(config.gradient_clipping),
            publish_bucket_numel=zero.allgather_bucket_numel, check_overflow=self._checks_overflow(config),
            compute_norm=bool(config.zero.compute_grad_norm),
            process_group=process_group, model_parallel_group=model_parallel_group, publisher=publisher,
            offload=offload, state_dtype=self._state_dtype, zero_stage=self.stage)
        if plan.client is not None:  # the script's optimizer: its param_groups are these (DeepSpeed's contract)
            adopt_client_groups(plan.client, self.optimizer)
        if self.stage3 is not None:  # DeepSpeed's owner of the ZeRO-3 hooks, which TRL reaches into for generation
            from hf_zero.zero.stage3.offload_view import ParameterOffloadView

            self.optimizer.parameter_offload = ParameterOffloadView(self.stage3)
        if self.stage < 3:
            self.reducer = GroupGradReducer(
                self.groups, mode=ReduceMode.ALL_REDUCE if self.stage == 0 else ReduceMode.REDUCE_SCATTER,
                bucket_numel=zero.reduce_bucket_numel, overlap=zero.overlap_comm,
                process_group=process_group, guard=self._backward.tolerate if self._guards_backward else None,
                average=config.gradient_allreduce_op.lower() == "mean")  # DeepSpeed's values: any case
        else:
            self.reducer = None
        if zero.require_every_gradient:  # zero_optimization.ignore_unused_parameters false (_check_every_gradient)
            self.reducer.arrived = set()
        if config.zero.zenflow is not None:
            self.zenflow = self._build_zenflow(config, process_group)
        if tp is not None and tp.mesh.get_local_rank() != 0:
            # replicated parameters have the same gradient on every TP rank: TP rank 0 alone counts them
            from hf_zero.runtime.tp_setup import replicated_spans

            self.optimizer.norm_excluded_spans = replicated_spans(self.groups)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self._finish_init(module, config)
        if self.device.type == "cpu":
            # what initialize freed (the weights a cast replaced, the model's unsharded copies) is not the training
            # loop's working set: out of the host cache (hf_zero/ops/host_cache.py), back to the kernel
            host_cache.empty_cache()

    def _build_zenflow(self, config: HfZeroConfig, process_group):
        """ZenFlow's selective optimizer and schedule (hf_zero/zero/zenflow.py), for the checks only the engine
        can make: the update rule it steps is Adam's. With fp16 it divides its gradients by the loss scale."""
        from hf_zero.config.policies import zenflow_policy
        from hf_zero.zero.zenflow import ZenFlow

        if not self.optimizer.backend.uses_adam_hyper:
            raise ConfigError("zero_optimization.zenflow", "needs an Adam or AdamW optimizer (its offloaded step is "
                                                           "Adam's with DeepSpeed's step count)")
        if self.model_parallel_group is not None or tp_info(self.module) is not None:
            raise ConfigError("zero_optimization.zenflow", "with pipeline or tensor parallelism is not implemented "
                                                           "in hf_zero; use data parallelism alone")
        hyper = (dict(config.optimizer.params) if config.optimizer is not None else
                 {k: self.optimizer.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")})
        return ZenFlow(zenflow_policy(config), self.groups, self.optimizer, self.optimizer.param_group_of, hyper,
                       steps_per_epoch=lambda: (len(self.training_dataloader)
                                                if getattr(self, "training_dataloader", None) is not None else None),
                       process_group=process_group, world_size=self.world_size, stage3=self.stage3,
                       loss_scaler=self.loss_scaler)

    def _check_every_gradient(self) -> None:
        """``zero_optimization.ignore_unused_parameters: false``: every trainable parameter must have had a gradient
        in this accumulation window, on every rank (DeepSpeed asserts it at the step). The ranks agree first, so
        each raises the same error, naming the parameters and on how many ranks they got none; nothing is stepped."""
        arrived, self.reducer.arrived = self.reducer.arrived, set()
        names = [n for g in self.groups for n, p in zip(g.names, g.params) if p.requires_grad]
        missing = torch.tensor([n not in arrived for n in names], dtype=torch.int32,
                               device=comm.bookkeeping_device(self.process_group))  # NCCL: on the GPU
        comm.all_reduce_(missing, group=self.process_group, what="the ignore_unused_parameters check")
        unused = [f"{n} ({int(c)} of {self.world_size} ranks)" for n, c in zip(names, missing.tolist()) if c]
        if unused:
            raise UnusedParametersError(
                f"hf_zero: zero_optimization.ignore_unused_parameters is false and {len(unused)} trainable "
                f"parameter(s) got no gradient in this accumulation window: {', '.join(unused[:10])}"
                f"{' ...' if len(unused) > 10 else ''}. Make every trainable parameter and forward output take part "
                "in the loss, freeze the unused ones (requires_grad=False), or set ignore_unused_parameters true "
                "(DeepSpeed's default)")

    def _cast_buffers(self, module: nn.Module, precision) -> None:
        """Buffers as DeepSpeed 0.19.8 leaves them at initialize (hf_zero/zero/buffer_dtypes.py): their own dtype
        unless ``data_types.buffer_dtype`` names one, the model's fp32 lists in fp32. Parameters are cast later, by
        the stage's groups. A batch-norm layer that cannot run that way is refused here rather than in its first
        forward, where DeepSpeed fails with torch's "expected scalar type BFloat16 but found Float"."""
        cast_module_buffers(module, param_dtype=self.compute_dtype, buffer_dtype=precision.buffer_dtype,
                            keep=precision.keep_in_fp32)
        norms = unusable_norms(module, self.compute_dtype)
        if norms:
            mode = "bf16" if self.compute_dtype == torch.bfloat16 else "fp16"
            value = "unset (buffers keep their dtype)" if precision.buffer_dtype is None else \
                f"{precision.buffer_dtype} for the buffers"
            raise ConfigError("data_types.buffer_dtype",
                              f"{value}, while {mode}.enabled trains the parameters in {self.compute_dtype}: torch's "
                              f"batch_norm cannot run {'; '.join(norms)}. Set \"data_types\": {{\"buffer_dtype\": "
                              f"\"{mode}\"}} to cast the buffers too (DeepSpeed's option; DeepSpeed fails in the "
                              f"first forward without it), or build the model under zero.Init with this config "
                              f"(stage 3), which builds floating buffers in {mode} as DeepSpeed's does")

    def _finish_init(self, module: nn.Module, config: HfZeroConfig) -> None:
        # flops_profiler: counts and reports the step whose global_steps == profile_step (hf_zero/profiling)
        self.step_profiler = StepProfiler(module, config.flops_profiler, rank=self.global_rank,
                                          world_size=self.world_size, micro_batch=self.train_micro_batch_size_per_gpu(),
                                          compute_dtype=self.compute_dtype, device=self.device)
        # the step-time roofline, fitted to this run's first measured steps (engine.step_time_model)
        offload = self.zero_policy.offload_optimizer
        self.step_time = StepTimeCalibrator(module, stage=self.stage, world_size=self.world_size,
                                            compute_dtype=self.compute_dtype, device=self.device,
                                            offload_optimizer=offload.device if offload is not None else "none")
        self.timers = self._timers  # hand the timers to the reducer / stage-3 runtime / offload (see the setter)
        # DeepSpeed's samples/s meter: started by each forward (or by the training loader's next batch), stopped by
        # step(); DeepSpeed-Chat's scripts call engine.tput_timer.update_epoch_count() after each epoch
        self.tput_timer = ThroughputTimer(config.timers.throughput, batch_size=self.train_batch_size(),
                                          steps_per_output=config.steps_per_print)
        # hybrid_engine: module.generate gathers a ZeRO-3 model once per call; eval() logs the round's breakdown
        self.hybrid = HybridGeneration(self, config.hybrid_engine) if config.hybrid_engine.enabled else None
        if config.disable_python_gc:  # automatic cyclic GC off while this engine lives (runtime/python_gc.py)
            self._gc_token = python_gc.hold()
        see_memory_usage("Engine after configure distributed model", force=self.memory_breakdown())

    def _no_optimizer(self, what: str = "") -> None:
        raise RuntimeError("hf_zero: this engine has no optimizer (initialize() got none and the config has no "
                           "\"optimizer\" section), so it is for evaluation only: run forward under torch.no_grad() "
                           "or pass an optimizer to train (DeepSpeed refuses backward and step the same way)")

    def _checks_overflow(self, config: HfZeroConfig) -> bool:
        """fp16 always skips a step whose gradients overflowed; bf16 only with ``bf16.check_grad_overflow``."""
        return self.loss_scaler is not None or (config.bf16.enabled is True and config.bf16.check_grad_overflow)

    # ---- timers ---------------------------------------------------------------------------------------------------
    @property
    def timers(self) -> PhaseTimers:
        return self._timers

    @timers.setter
    def timers(self, timers: PhaseTimers) -> None:
        """Replacing the timers (the HF callback does) also re-points every component that times its waits."""
        self._timers = timers
        if getattr(self, "reducer", None) is not None:
            self.reducer.timers = timers
        if getattr(self, "stage3", None) is not None:
            self.stage3.set_timers(timers)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "backend", None) is not None:
            optimizer.backend.timers = timers

    # ---- construction ---------------------------------------------------------------------------------------------
    def _init_stages_0_to_2(self, plan: OptimizerPlan, names: dict, grad_dtype: torch.dtype) -> list[ShardedGroup]:
        from hf_zero.runtime.moe_setup import expert_placement, split_plan_groups

        shard_world = 1 if self.stage == 0 else self.world_size
        shard_rank = 0 if self.stage == 0 else self.global_rank
        self._broadcast_module_from_rank0()
        if plan is not None:  # expert-parallel parameters in groups of their own (a client's stay one param group)
            self._param_group_of = split_plan_groups(plan, self._expert_groups, self.stage)
        groups = []
        seen: set[nn.Parameter] = set()
        for params, _ in (plan.groups if plan is not None else ()):  # no plan: an evaluation engine
            trainable = [p for p in params if p.requires_grad and p not in seen]
            seen.update(trainable)
            expert = expert_placement(trainable, self._expert_groups)
            world, rank = shard_world, shard_rank
            if expert is not None and self.stage > 0:  # cut over the ranks holding the same experts (EDP group)
                world, rank = expert.edp_size, expert.edp_rank
            groups.append(ShardedGroup(trainable, [names.get(p, "?") for p in trainable], world_size=world,
                                       rank=rank, compute_dtype=self.compute_dtype, grad_dtype=grad_dtype,
                                       persistent_grad=False, master_dtype=self._master_dtype, expert=expert))
        # masters were taken in fp32 before this cast; the model computes in 16 bit from here on
        if self.compute_dtype != torch.float32:
            for p in self.module.parameters():
                if p.is_floating_point():
                    local = local_tensor(p)  # a tensor-parallel DTensor casts its own shard
                    local.data = local.data.to(self.compute_dtype)
        return groups

    def _init_stage3(self, plan: OptimizerPlan, names: dict, grad_dtype: torch.dtype) -> list[ShardedGroup]:
        from hf_zero.zero.stage3_groups import build_stage3_groups

        from hf_zero.runtime.bnb_compat import keep_4bit_layout

        self.stage3, groups = build_stage3_groups(self.module, plan, self.zero_policy, self.compute_dtype, grad_dtype,
                                                  process_group=self.process_group, master_dtype=self._master_dtype)
        keep_4bit_layout(self.module)  # a partitioned 4-bit weight cannot be repacked in place by bitsandbytes
        return groups

    def _broadcast_module_from_rank0(self) -> None:
        """Every rank starts from the group's rank 0's weights (models built with different seeds still train as
        one). ``broadcast`` names its source by global rank: the group's first member, which is global rank 0 only
        when the group is the whole world."""
        if self.world_size == 1:
            return
        if self._expert_groups:  # expert-parallel experts from the first rank holding the same ones
            from hf_zero.runtime.moe_setup import broadcast_module

            broadcast_module(self.module, self._expert_groups, self.process_group)
            return
        src = torch.distributed.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                comm.broadcast(local_tensor(t.data), src=src, group=self.process_group)

    def _build_scheduler(self, client: Any):
        if client is not None:
            # a scheduler object, or a callable that builds one from the optimizer (transformers' DummyScheduler)
            if callable(client) and not hasattr(client, "step"):
                return client(self.optimizer)
            return client
        sched = self._config.scheduler
        if sched is None:
            return None
        from hf_zero.runtime.lr_schedules import build_lr_scheduler

        return build_lr_scheduler(sched.type, dict(sched.params), self.optimizer)

    # ---- DeepSpeed's engine API -----------------------------------------------------------------------------------
    @property
    def config(self) -> dict:
        """The resolved config as a plain dict (transformers and accelerate read it)."""
        return dict(self._config.raw)

    def forward(self, *args, **kwargs):
        see_memory_usage("Engine before forward", force=self.memory_breakdown())
        if self.training_dataloader is None:  # with DeepSpeed's loader, fetching the batch starts it (as there)
            self.tput_timer.start()
        if self.curriculum_scheduler_legacy is not None and self.module.training:
            difficulty = self.curriculum_scheduler_legacy.update_difficulty(self.global_steps + 1)
            if self._config.curriculum_learning.curriculum_type == "seqlen":
                kwargs = {**kwargs, "curriculum_seqlen": difficulty}
        if self.random_ltd_scheduler is not None and self.module.training:
            self.random_ltd_scheduler.update_seq(self.global_steps)
        if self.progressive_layer_drop is not None and self.module.training:
            kwargs = {**kwargs, **self.progressive_layer_drop.get_state()}
        if self._config.fp16.auto_cast:  # positional inputs only, as DeepSpeed (runtime/input_cast.py)
            args = cast_inputs_half(args)
        self.step_time.forward(args, kwargs)
        with self.timers.phase("forward"), self.step_profiler.forward(self.global_steps, args, kwargs):
            try:
                if self._autocast is not None:
                    with torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype):
                        out = self.module(*args, **kwargs)
                else:
                    out = self.module(*args, **kwargs)
            except Exception as error:
                if self.stage3 is not None:
                    self.stage3.annotate_forward_error(error)  # names a module using partitioned parameters
                raise
        if torch.is_grad_enabled() and self.optimizer is not None:
            self._backward.watch(out)  # loss.backward() on this output then does what engine.backward(loss) does
        see_memory_usage("Engine after forward", force=self.memory_breakdown())
        return out

    def is_gradient_accumulation_boundary(self) -> bool:
        if not self._managed_gas:  # the caller owns the boundary: it is the step() now running, if any
            return self._in_caller_step
        if self._boundary_override is not None:
            return self._boundary_override
        if self.zenflow is not None:  # warm-up, update_interval and select boundaries (zero/zenflow.py)
            return self.zenflow.is_update_boundary(self.micro_steps)
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Let the caller (accelerate) decide where accumulation ends, instead of counting micro-steps."""
        if not self._managed_gas:
            raise ConfigAssertionError("managed_gradient_accumulation",
                                       "false, and set_gradient_accumulation_boundary() was called: each "
                                       "engine.step() is the boundary already (DeepSpeed refuses the call too); drop "
                                       "the call or the key")
        self._boundary_override = bool(is_boundary)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of ``loss`` (divided by the accumulation steps when ``scale_wrt_gas``; times the fp16 scale).
        ``loss.backward()`` on a loss computed from ``engine(...)``'s output does the same (runtime/backward.py).
        Returns the loss divided by the accumulation steps (``scale_wrt_gas``), without the fp16 scale, as
        DeepSpeed's does."""
        if self.optimizer is None:
            self._no_optimizer()
        _check_loss(loss, "backward")
        self._backward.last_loss = loss
        self._backward.scale_wrt_gas = scale_wrt_gas
        gas_scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        scaled = gas_scaled * self.loss_scaler.scale if self.loss_scaler is not None else gas_scaled
        # (a direct loss.backward() is not inside the profiler's backward window: its FLOPs are not counted)
        with self.step_profiler.backward(self.global_steps):
            self._backward.run_engine_backward(scaled, retain_graph)
        return gas_scaled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, for ``engine.scale(loss).backward()`` (DeepSpeed's manual backward);
        the accumulation-steps division is applied on the engine's outputs as for any direct backward."""
        if self.optimizer is None:
            self._no_optimizer()
        _check_loss(loss, "scale")
        self._backward.mark_user_scaled()
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def _begin_backward(self) -> None:
        """Prologue of every backward pass (engine.backward or a direct one): does this micro-step reduce?"""
        see_memory_usage("Engine before backward", force=self.memory_breakdown())
        self._backwards_since_step += 1
        if self.reducer is not None:
            self.reducer.begin((self.stage == 2 or self.is_gradient_accumulation_boundary())
                               and not self._inside_no_sync and not self._coalescing)
        elif self.stage3 is not None:
            self.stage3.begin_backward()  # a module's forward from here on is a checkpointing recomputation
        if self.zenflow is not None:
            self.zenflow.begin_backward(self.micro_steps)

    def _end_backward(self) -> None:
        if self.reducer is not None:
            reduced = self.reducer.reducing
            self.reducer.finish()
            if reduced and self.stage == 0:  # DeepSpeed without ZeRO leaves the averaged gradients in p.grad
                self.reducer.expose_grads()
        else:
            self.stage3.finish_backward()
        if self.zenflow is not None:  # the selective update of this micro-step (or its gradients kept)
            self.zenflow.end_backward(self.micro_steps, self.is_gradient_accumulation_boundary())
        see_memory_usage("Engine after backward", force=self.memory_breakdown())

    def step(self, lr_kwargs: dict | None = None) -> None:
        """At the accumulation boundary: optimizer step, scheduler step, counters, logging."""
        if self.optimizer is None:
            self._no_optimizer()
        block = self._gradient_block()
        if block is not None:
            # the block's gradients are not reduced yet: a step now would apply this rank's alone (DeepSpeed
            # refuses it too: "It is illegal to call Engine.step() inside no_sync context manager")
            raise UsageError(f"hf_zero: engine.step() inside engine.{block}(): the gradients of the backward passes "
                             "inside are reduced only after the block; call step() after the with-block (DeepSpeed's "
                             "words, for both blocks: It is illegal to call Engine.step() inside no_sync context "
                             "manager)")
        see_memory_usage("Engine before step", force=self.memory_breakdown())
        if not self._managed_gas:
            # managed_gradient_accumulation false: this call is the boundary. Stages 0/1 reduce here what the
            # backward passes since the last step summed on this rank; stages 2/3 reduced in each backward already
            self._in_caller_step = True
            try:
                if self.reducer is not None and self.stage < 2:
                    self._reduce_held_gradients()
                self._step(lr_kwargs)
            finally:
                self._in_caller_step = False
        else:
            self._step(lr_kwargs)
        see_memory_usage("Engine after step", force=self.memory_breakdown())

    def _reduce_held_gradients(self) -> None:
        """Reduce, in one pass, the gradients backward passes left summed in ``param.grad`` without reducing them
        (stages 0-2: the end of coalesce_grad_reduction, and step() with managed_gradient_accumulation false)."""
        self.reducer.begin(True)
        self.reducer.finish()
        if self.stage == 0:
            self.reducer.expose_grads()

    def _step(self, lr_kwargs: dict | None) -> None:
        self._step_applied = False  # a step() between boundaries, or one an fp16 overflow skipped, applies nothing
        boundary = self.is_gradient_accumulation_boundary()
        if self.zenflow is not None:  # DeepSpeed: the selective lr is synced, the Adam step count is the micro-step's
            self.zenflow.sync_lr()
            self.optimizer.adam_step_override = self.micro_steps + 1
        if boundary:
            if self.reducer is not None and self.reducer.arrived is not None:
                self._check_every_gradient()
            if self.zenflow is not None:  # overlap_step: this window's Adam moments
                self.zenflow.before_offloaded_step(self.micro_steps)
            if self.progressive_layer_drop is not None:  # DeepSpeed: with the count before this step's increment
                self.progressive_layer_drop.update_state(self.global_steps)
            # ZenFlow at stage 3 writes its selected columns back after the step: the persistent parameters are
            # re-gathered once, after both writers
            coalesce = (self.stage3.coalesced_shard_changes() if self.stage3 is not None and self.zenflow is not None
                        else contextlib.nullcontext())
            with coalesce:
                with self.timers.phase("step"), self.step_profiler.step(self.global_steps):
                    self.optimizer.step()
                self._step_applied = not self.optimizer.overflow
                if self.zenflow is not None:
                    self.zenflow.after_offloaded_step()
            if self.reducer is not None:
                self.reducer.hide_grads()  # stage 0's p.grad views: the step has used them
            if self.lr_scheduler is not None and not self.optimizer.overflow:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.step_profiler.finish_step(self.global_steps)
            if self.device.type == "cpu":
                host_cache.trim()  # blocks idle for a whole step go back to the kernel
            self.global_steps += 1
            # DeepSpeed's count: the global batch, or with the caller owning the boundary, its micro-batches
            self.global_samples += (self.train_batch_size() if self._managed_gas else
                                    self._backwards_since_step * self.train_batch_size()
                                    // self.gradient_accumulation_steps())
            self._backwards_since_step = 0
            self.step_time.boundary()
            if self.monitor.enabled:
                timed = self._config.wall_clock_breakdown and self._monitors_phase_times
                self.monitor.write_events(boundary_events(
                    self.global_samples, self.get_lr()[0], self.get_loss_scale() if self.fp16_enabled() else None,
                    self.timers.seconds if timed else None))
            self._log_step()
        elif self.zenflow is not None and self.lr_scheduler is not None:  # ZenFlow's schedule moves every micro-step
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.tput_timer.stop(global_step=boundary, report_speed=self.global_rank == 0)
        if self.hybrid is not None:
            self.hybrid.after_step()
        self.micro_steps += 1
        self._boundary_override = None

    @property
    def step_time_model(self):
        """The step-time roofline calibrated on this run's first measured steps
        (:class:`hf_zero.profiling.step_calibration.CalibratedStepTime`), None until then or when the model's
        FLOPs are not known analytically."""
        return self.step_time.result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def get_global_grad_norm(self) -> float | None:
        """The true norm of the full gradient at the last step (before clipping, after unscaling)."""
        return self.optimizer.global_grad_norm if self.optimizer is not None else None

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps if self.optimizer is not None else 0

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self._config.train_micro_batch_size_per_gpu)

    def train_batch_size(self) -> int:
        return int(self._config.train_batch_size)

    def gradient_accumulation_steps(self) -> int:
        if self.zenflow is not None:  # DeepSpeed's configure_zenflow replaces it by update_interval
            return self.zenflow.gradient_accumulation_steps
        return int(self._config.gradient_accumulation_steps)

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_optimization(self) -> bool:
        return self.stage > 0

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._config.zero.gather_16bit_weights_on_model_save)

    def torch_autocast_enabled(self) -> bool:
        return self._autocast is not None

    def torch_autocast_dtype(self) -> torch.dtype | None:
        return self._autocast_dtype

    def bfloat16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    @property
    def local_rank(self) -> int:
        """This process's index on its node (LOCAL_RANK; DeepSpeed scripts pick their device with it)."""
        return comm.get_local_rank()

    def load_universal_checkpoint(self) -> bool:
        """DeepSpeed's getter: ``checkpoint.load_universal`` (load_checkpoint reads DeepSpeed universal checkpoints,
        the tag named by ``latest_universal``)."""
        return bool(self._config.checkpoint.load_universal)

    def use_node_local_storage(self) -> bool:
        """DeepSpeed's getter: ``checkpoint.use_node_local_storage`` (every node writes its own checkpoint copy)."""
        return bool(self._config.checkpoint.use_node_local_storage)

    @property
    def device(self) -> torch.device:
        """The device this engine trains on (``cuda:LOCAL_RANK`` or the CPU): batches go here."""
        return self._device

    # ---- moving state off the accelerator between uses (hf_zero/zero/state_offload.py) --------------------------
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Move the chosen states (``OffloadStateTypeEnum``; all when None) to CPU memory until
        :meth:`reload_states`. On a CPU-only machine they already are there and nothing moves."""
        if self.optimizer.offload is not None:
            raise ValueError("hf_zero: engine.offload_states() with zero_optimization.offload_optimizer set: the "
                             "optimizer states are already offloaded and managed by the optimizer offload")
        if any(getattr(g, "param16", 0) is None for g in self.groups):
            raise ValueError("hf_zero: engine.offload_states() with zero_optimization.offload_param nvme: the "
                             "parameters already live in swap files")
        self._state_offloader().offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move every state :meth:`offload_states` moved back to the device it came from."""
        self._state_offloader().reload(non_blocking)

    def _state_offloader(self):
        from hf_zero.zero.state_offload import StateOffloader

        if getattr(self, "_offloader", None) is None:
            self._offloader = StateOffloader(self.groups, self.optimizer, self.module)
        return self._offloader

    # ---- checkpoints (hf_zero/checkpoint/engine.py does the work) --------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        if self.optimizer is None:
            self._no_optimizer()
        if save_dir is None or not str(save_dir):  # "" would be the working directory (DeepSpeed refuses both)
            raise ValueError(f"hf_zero: save_checkpoint(save_dir={save_dir!r}): name the directory to save into")
        from hf_zero.checkpoint.tags import resolve_save_tag

        tag = resolve_save_tag(tag, f"global_step{self.global_steps}", self._config.checkpoint.tag_validation)
        if tp_info(self.module) is not None:
            if self._config.checkpoint.use_node_local_storage:  # tp.py writes one directory
                raise NotImplementedError(
                    "hf_zero: checkpoint.use_node_local_storage is not supported for tensor-parallel checkpoints: "
                    "save them to a directory every node shares")
            from hf_zero.checkpoint.tp import save_tp_checkpoint

            return save_tp_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                      exclude_frozen_parameters=exclude_frozen_parameters)
        from hf_zero.checkpoint.engine import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable | None = None):
        if self.optimizer is None:
            self._no_optimizer()
        if custom_load_fn is not None:  # refused, not silently dropped: the load would not be what the caller asked
            raise NotImplementedError(
                "hf_zero: load_checkpoint(custom_load_fn=...) is not supported: hf_zero checkpoints are resharded "
                "per parameter on load, so there is no (src, dst) module state to hand to it. Load with "
                "load_module_only=True and apply your function to engine.module afterwards (stages 0-2), or "
                "inside hf_zero.zero.GatheredParameters (stage 3).")

        from hf_zero.checkpoint.tp import is_tp_checkpoint, load_tp_checkpoint

        if tp_info(self.module) is not None or is_tp_checkpoint(load_dir, tag):
            if self.load_universal_checkpoint():
                raise NotImplementedError("hf_zero: checkpoint.load_universal with tensor parallelism: DeepSpeed "
                                          "universal checkpoints load into ZeRO engines (stages 0-3) only; hf_zero's "
                                          "own tensor-parallel checkpoints re-cut on load without it")
            return load_tp_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                      load_optimizer_states=load_optimizer_states and not load_module_only,
                                      load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only)
        from hf_zero.checkpoint.engine import load_checkpoint

        return load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states and not load_module_only,
                               load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
                               universal=self.load_universal_checkpoint())

    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The full model state dict on every rank (stages 0-2: parameters are whole everywhere). A tensor-parallel
        model's shards are gathered into the unsplit tensors (a collective over the TP group: call on every rank)."""
        if tp_info(self.module) is not None:
            from hf_zero.tensor_parallel.state import full_state_dict

            sd = full_state_dict(self.module)
        else:
            sd = self.module.state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        return sd

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """Full 16-bit state dict on rank 0 (None on other ranks); called on every rank."""
        if self.stage3 is None:
            sd = self.module_state_dict(exclude_frozen_parameters)
            if self._expert_groups:  # every expert under its global index (a collective): the ep_size=1 model's
                from hf_zero.moe.state import global_state_dict

                sd = global_state_dict(self.module, sd)
            return {k: v.detach().clone() for k, v in sd.items()} if self.global_rank == 0 else None
        from hf_zero.zero.stage3.consolidate import consolidated_state_dict

        full_of = None
        if tp_info(self.module) is not None:  # each gathered TP shard joined with its TP group's (unsplit model)
            from hf_zero.tensor_parallel.state import full_tensor

            def full_of(name, t):
                return full_tensor(self.module, name, t)
        return consolidated_state_dict(self.module, exclude_frozen=exclude_frozen_parameters, full_of=full_of,
                                       group=self.process_group)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """What accelerate's ``get_state_dict`` asks a tensor-parallel DeepSpeed engine for: the full weights on the
        first data-parallel replica (None elsewhere); called on every rank."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model's 16-bit weights in one file on rank 0 (every rank calls it): a torch.save state dict
        under DeepSpeed's default name, safetensors when ``save_filename`` ends in ``.safetensors``."""
        from hf_zero.checkpoint.engine import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    # ---- logging ----------------------------------------------------------------------------------------------------
    def _log_step(self) -> None:
        every = self._config.steps_per_print
        if every is None or self.global_steps % every != 0 or self.global_rank != 0:
            if self._config.wall_clock_breakdown:
                self.timers.reset()
            return
        norm = self.optimizer.global_grad_norm
        loss = self._backward.last_loss if self._backward.last_loss is not None else float("nan")
        msg = (f"step={self.global_steps} loss={loss:.4f} "
               f"lr={','.join(f'{lr:.3g}' for lr in self.get_lr())} grad_norm={norm if norm is not None else 0:.4g} "
               f"loss_scale={self.get_loss_scale():g} skipped={self.skipped_steps}")
        if self._config.wall_clock_breakdown:
            msg += " | " + self.timers.summary()
            self.timers.reset()
        logger.info("hf_zero: %s", msg)

    def train(self, mode: bool = True):
        """``nn.Module.train`` (``eval()`` is ``train(False)``); with ``hybrid_engine`` also the generation round's
        timing (hf_zero/runtime/hybrid_engine.py)."""
        if self.hybrid is not None and not mode:
            self.hybrid.before_eval()
        out = super().train(mode)
        if self.hybrid is not None and mode:
            self.hybrid.after_train()
        return out

    def destroy(self) -> None:
        """Remove the gradient / gather hooks (the model is usable on its own afterwards)."""
        if self.hybrid is not None:
            self.hybrid.close()
        if self.reducer is not None:
            self.reducer.remove()
        if self.zenflow is not None:
            self.zenflow.remove()
        if self.stage3 is not None:
            self.stage3.remove()
        backend = getattr(self.optimizer, "backend", None)
        if backend is not None:  # an offload back-end waits for swap I/O, deletes this rank's NVMe swap files
            backend.close()
        self.monitor.close()
        if self._gc_token is not None:
            python_gc.release(self._gc_token)
            self._gc_token = None

    # ---- Hugging Face integration surface (owned by the HF integration) ----
    def compile(self, backend: str | None = None, compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """``torch.compile`` the wrapped model in place (accelerate calls this when a dynamo backend is configured,
        as it does DeepSpeed's ``engine.compile``). The ZeRO-3 hooks run between the compiled graphs
        (zero/stage3/hooks.py); a second call does nothing, as in DeepSpeed."""
        if schedule is not None:
            raise ValueError("hf_zero: engine.compile(schedule=...) (DeepCompile passes) is not supported")
        if self.is_compiled:
            return
        if compiled_autograd_enabled:
            # the gradient hooks (reduce, partition, overflow checks) cannot be traced into compiled autograd's
            # graph; the forward is compiled, backward runs autograd's own engine -- same gradients
            logger.warning("hf_zero: engine.compile(compiled_autograd_enabled=True): compiled autograd is not "
                           "used (hf_zero's gradient hooks are not traceable); the model is compiled and backward "
                           "runs eagerly, with the same gradients")
        kwargs = dict(compile_kwargs or {})
        if backend is not None:
            kwargs["backend"] = backend
        if self.stage3 is not None and not self.stage3.whole:
            # one graph per hooked module, compiled once per (class, parameter shapes, requires_grad): a model with
            # more variants than dynamo's per-code recompile limit (8) would run the rest eagerly, with a warning
            import torch._dynamo

            needed = self.stage3.hooked_module_variants() + 2
            if needed > torch._dynamo.config.recompile_limit:
                logger.info("hf_zero: engine.compile raises torch._dynamo.config.recompile_limit from %d to %d: "
                            "ZeRO-3 compiles each module with gathered parameters as its own graph, and this model "
                            "has %d kinds of them", torch._dynamo.config.recompile_limit, needed, needed - 2)
                torch._dynamo.config.recompile_limit = needed
        self.module.compile(**kwargs)
        self._hf_is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_hf_is_compiled", False)

    def phase_seconds_total(self) -> dict[str, float]:
        """Seconds spent in each timed phase (forward, backward, step, ...) since phase timing started, which is at
        the first call of this method (the HF ``HfZeroCallback`` turns it from that into time shares)."""
        if not isinstance(self.timers, TotalingTimers):
            self.timers = TotalingTimers.replacing(self.timers)
        return self.timers.totals()

    # ---- DeepSpeed's data loader (hf_zero/runtime/dataloader.py) ----
    training_dataloader = None  # the loader initialize(training_data=...) returned, as DeepSpeed keeps it
    collate_fn = None           # initialize(collate_fn=...): deepspeed_io's default

    def deepspeed_io(self, dataset, batch_size=None, route="train", pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        """DeepSpeed's loader over ``dataset``: sharded by data-parallel rank, micro-batch sized by default, the
        last partial batch kept unless ``dataloader_drop_last``; ``route="eval"``/``"predict"`` do not shuffle."""
        from hf_zero.runtime.dataloader import build_loader

        layout = self.__dict__.get("parallel_layout")
        batch_size = batch_size if batch_size is not None else self.train_micro_batch_size_per_gpu()
        return build_loader(dataset, batch_size,
                            dp_size=layout.dp_size if layout is not None else self.world_size,
                            dp_rank=layout.dp_rank if layout is not None else self.global_rank,
                            route=route, pin_memory=pin_memory, data_sampler=data_sampler,
                            collate_fn=collate_fn if collate_fn is not None else self.collate_fn,
                            num_local_io_workers=num_local_io_workers,
                            drop_last=bool(self._config.dataloader_drop_last),
                            tput_timer=self.tput_timer if route == "train" else None)


def _autocast_dtype(section, device: torch.device) -> torch.dtype:
    """The ``torch_autocast.dtype`` as a torch dtype; unset: the device's autocast default, as DeepSpeed."""
    from hf_zero.config.sections import AUTOCAST_DTYPES

    if section.dtype is None:
        return torch.get_autocast_dtype(device.type)
    return getattr(torch, AUTOCAST_DTYPES[section.dtype])


def _bf16_state_dtypes(config: HfZeroConfig, stage: int, grad_dtype: torch.dtype, plan) -> tuple:
    """(master dtype, optimizer-state dtype) from ``bf16.bf16_master_weights_and_grads`` / ``bf16_optimizer_states``,
    refusing what DeepSpeed refuses (stage 0, states without master) and what hf_zero cannot do yet."""
    bf16 = config.bf16
    if not bf16.bf16_master_weights_and_grads:
        if bf16.bf16_optimizer_states:
            raise ConfigError("bf16.bf16_optimizer_states", "true needs bf16.bf16_master_weights_and_grads true "
                                                            "(as in DeepSpeed)")
        return torch.float32, torch.float32
    key = "bf16.bf16_master_weights_and_grads"
    if bf16.enabled is not True:
        raise ConfigError(key, "true needs bf16.enabled true")
    if stage == 0:
        raise ConfigError(key, "true needs ZeRO stage 1, 2 or 3 (as in DeepSpeed)")
    if grad_dtype != torch.bfloat16:
        raise ConfigError(key, "true keeps gradients in bf16; remove data_types.grad_accum_dtype")
    states = torch.bfloat16 if bf16.bf16_optimizer_states else torch.float32
    if plan is not None and not plan.fused_adam and states != torch.bfloat16:
        raise ConfigError(key, f"true with the {plan.inner_cls.__name__} optimizer keeps its states in bf16 too: set "
                               "bf16.bf16_optimizer_states true (or use Adam/AdamW, whose fp32 moments hf_zero keeps)")
    return torch.bfloat16, states
