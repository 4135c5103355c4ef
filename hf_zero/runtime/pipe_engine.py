"""The pipeline engine: DeepSpeed's ``train_batch``/``eval_batch`` over torch's pipeline schedules, with hf_zero's
ZeRO engine (stages 0-3, optimizer offload) on each stage's data-parallel replicas.

    engine, _, _, _ = hf_zero.initialize(model=PipelineModule(...), config=cfg)   # or hf_zero.pipeline.wrap(hf)
    loss = engine.train_batch(data_iter)      # gradient_accumulation_steps micro-batches, one optimizer step

One step:
  1. the schedule (torch.distributed.pipelining: GPipe, 1F1B, interleaved, ...) runs every micro-batch's forward
     and backward; losses are pre-scaled (1/micro-batches, or 1/global tokens), so gradients are sums already;
  2. stages 0-2: the accumulated gradients are reduced over the data-parallel group once (at ZeRO-2 this keeps the
     full gradient for the step, like ZeRO-1: reducing every micro-batch would cost m times the traffic);
     stage 3 reduced each micro-batch's gradients into their shards as it went (the stage calls finish_backward);
  3. tied weights (an embedding on the first and the last stage): the copies' gradient shards are summed;
  4. the optimizer step; the gradient norm (clipping, fp16 overflow) is summed over every stage, a tied weight
     counted once, so the update equals the unsplit model's. Without tensor parallelism the squared norm and the
     loss travel together from the last stage to the first and back in one broadcast (pipeline/stage_sum.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import warnings
from typing import Any, Iterable

import torch
import torch.distributed as dist

from hf_zero import comm
from hf_zero.config import HfZeroConfig
from hf_zero.config.errors import ConfigAssertionError, ConfigError
from hf_zero.pipeline.config import parse_pipeline_config
from hf_zero.pipeline.failure import StageFailureGuard
from hf_zero.pipeline.module import PipelineError
from hf_zero.pipeline.schedules import EngineStage, build_schedule, check_schedule
from hf_zero.pipeline.stage_sum import sum_over_stages
from hf_zero.runtime.engine import HfZeroEngine
from hf_zero.runtime.optimizers import OptimizerPlan

__all__ = ["PipelineEngine"]

logger = logging.getLogger("hf_zero")


def _split_tied(plan: OptimizerPlan, tied_groups) -> tuple[OptimizerPlan, dict[int, Any]]:
    """The plan with each tied key's parameters in their own optimizer group(s), so their gradient shards line up
    between the stages holding copies (same parameters, same order, same data-parallel size)."""
    tied_of = {p: tg for tg in tied_groups for p in tg.params}
    groups, tied_index = [], {}
    for params, hyper in plan.groups:
        plain = [p for p in params if p not in tied_of]
        if plain:
            groups.append((plain, hyper))
    for tg in tied_groups:
        for params, hyper in plan.groups:
            mine = [p for p in tg.params if any(p is q for q in params)]
            if mine:
                tied_index[len(groups)] = tg
                groups.append((mine, hyper))
    same = not tied_index and len(groups) == len(plan.groups)  # the client's groups, one for one
    if plan.client is not None and not same:
        warnings.warn("hf_zero: this pipeline stage splits the client optimizer's parameter groups (tied or absent "
                      "parameters), so its param_groups cannot be the engine optimizer's: an LR scheduler built on "
                      "that optimizer before initialize does not set the trained learning rate. Pass the scheduler "
                      "as a callable (lr_scheduler=lambda optimizer: ...) or use the config's scheduler section",
                      RuntimeWarning, stacklevel=3)
    return OptimizerPlan(plan.inner_cls, plan.defaults, plan.fused_adam, groups,
                         client=plan.client if same else None), tied_index


class PipelineEngine(HfZeroEngine):
    """``train_batch``/``eval_batch`` only: ``forward``, ``backward`` and ``step`` raise :class:`PipelineError`."""

    _guards_backward = False  # backward runs inside the pipeline schedule, never through engine.backward
    _monitors_phase_times = False  # DeepSpeed's pipeline engine monitors train_loss / eval_loss instead
    pipeline_parallelism = True

    def __init__(self, module, config: HfZeroConfig, plan: OptimizerPlan, lr_scheduler: Any = None):
        grid = module.grid
        pcfg = parse_pipeline_config(config.pipeline, model_parallel_size=grid.model_parallel_size)
        self._check_against_module(pcfg, module)
        # refused before anything is built or communicated
        if not config.managed_gradient_accumulation:
            raise ConfigAssertionError("managed_gradient_accumulation",
                                       "false is not supported with pipeline parallelism: train_batch() runs "
                                       "gradient_accumulation_steps micro-batches and steps itself (DeepSpeed "
                                       "refuses it too)")
        check_schedule(pcfg.schedule, num_microbatches=int(config.gradient_accumulation_steps),
                       num_stages=grid.pipe_parallel_size, virtual_stages=module.virtual_stages)
        if int(config.zero.stage) == 3 and module.virtual_stages > 1:
            raise ConfigError("pipeline.virtual_stages", "ZeRO-3 with several virtual stages per rank is not "
                                                        "supported; use ZeRO 0-2 or virtual_stages 1")
        plan, tied_index = _split_tied(plan, module.tied_groups)
        mp_group = grid.get_model_parallel_group() if grid.get_model_parallel_world_size() > 1 else None
        super().__init__(module, config, plan, lr_scheduler=lr_scheduler,
                         process_group=grid.get_data_parallel_group(), model_parallel_group=mp_group)
        self.grid = grid
        self.pipeline_config = pcfg
        self.num_stages = grid.pipe_parallel_size
        self.stage_id = grid.stage_id
        self._tied_index = tied_index
        self.optimizer.norm_excluded_groups = {gi for gi, tg in tied_index.items()
                                               if not tg.counted_here(self.stage_id)}
        self.micro_batches = self.gradient_accumulation_steps()
        self._schedule = None
        self._shape_key = None
        self._loss_fn = None
        self.data_iterator = None
        self.batch_fn = None
        self._guard = StageFailureGuard(grid, describe=f"pipeline stage {self.stage_id}")
        self._dp_loss_group = grid.get_data_parallel_group()
        # the model-parallel ranks are exactly the pipeline stages (no tensor parallelism): the norm's sum over
        # them also brings the step's loss to every stage
        self._loss_rides_norm = self.num_stages > 1 and grid.get_model_parallel_world_size() == self.num_stages
        self._step_loss = torch.zeros(())
        if self._loss_rides_norm:
            self.optimizer.model_parallel_sum = self._sum_norm_and_loss

    @staticmethod
    def _check_against_module(pcfg, module) -> None:
        if pcfg.stages is not None and pcfg.stages != module.num_stages:
            raise ConfigError("pipeline.stages", f"is {pcfg.stages} but the model is cut into {module.num_stages} "
                                                 f"stages; set it to \"auto\" or {module.num_stages}")
        if pcfg.partition is not None and pcfg.partition != getattr(module, "partition_method", None):
            raise ConfigError("pipeline.partition", f"is {pcfg.partition!r} but the model was partitioned with "
                                                    f"{getattr(module, 'partition_method', None)!r}; the model's "
                                                    f"constructor decides: remove the key or make them equal")
        if pcfg.seed_layers is not None and pcfg.seed_layers != getattr(module, "seed_layers", False):
            raise ConfigError("pipeline.seed_layers", "differs from the model's seed_layers (set at construction, "
                                                      "before the layers were built); make them equal")
        if pcfg.virtual_stages is not None and pcfg.virtual_stages != module.virtual_stages:
            raise ConfigError("pipeline.virtual_stages", f"is {pcfg.virtual_stages} but the model was built with "
                                                         f"{module.virtual_stages} chunks per rank; pass "
                                                         f"virtual_stages={pcfg.virtual_stages} to the model")
        # pipeline.activation_checkpoint_interval is applied before the engine: runtime/parallelize.py, step 3

    # ---- DeepSpeed's pipeline-engine API ------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterable) -> None:
        self.data_iterator = iterator

    def set_dataloader(self, loader: Iterable) -> None:
        """DeepSpeed's: train_batch() reads from ``loader`` (an iterator over it is taken now)."""
        self.training_dataloader = loader
        self.data_iterator = iter(loader)

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_has_attention_mask(self, value: bool) -> None:
        """DeepSpeed's switch for sending boolean tensors (attention masks) between stages, which its own p2p code
        converts; hf_zero's stages exchange tensors through torch.distributed.pipelining, which sends each with its
        own dtype, so the value is kept and changes nothing."""
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask: expected a bool, got {type(value).__name__}")
        self.has_attention_mask = value

    def set_batch_fn(self, fn) -> None:
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """The next batch re-runs shape inference between stages (a different sequence length)."""
        self._schedule = None

    def forward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def train_batch(self, data_iter: Iterable | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; the mean loss on every rank."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() needs gradients; it was called under torch.no_grad()")
        curriculum = self.curriculum_scheduler_legacy
        if curriculum is not None:  # as DeepSpeed's pipeline engine: the model reads the difficulty itself, and a
            before = curriculum.get_current_difficulty()  # new sequence length means new activation shapes
            if curriculum.update_difficulty(self.global_steps + 1) != before:
                self.reset_activation_shape()
        self.module.train()
        losses: list[torch.Tensor] = []
        with self._guard.step("train_batch"):
            args, kwargs, target = self._next_batch(data_iter)
            schedule = self._schedule_for(args, kwargs, target)
            with self.timers.phase("forward"), self._stage_gathered():  # forward and backward interleave
                schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
            self._reduce_gradients()
            self._step_loss = self._local_loss(losses)
            self._boundary_override = True
            with self.timers.phase("step"):
                HfZeroEngine.step(self)
            loss = self._step_loss if self._loss_rides_norm else self._broadcast_loss(self._step_loss)
        self._backward.last_loss = float(loss.item())  # what the step log prints
        if self.monitor.enabled:  # after the step's lr event, at the same sample count (DeepSpeed's order)
            self.monitor.write_events([("Train/Samples/train_loss", loss.mean().item(), self.global_samples)])
        return loss

    def eval_batch(self, data_iter: Iterable, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None):
        """Forward only over ``num_micro_batches`` (default: gradient_accumulation_steps) micro-batches: the mean
        loss on every rank (``bcast_loss``), and with ``return_logits`` the last stage's outputs too."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}")
        if not compute_loss and not return_logits:
            raise ValueError("eval_batch: nothing to return (compute_loss=False and return_logits=False)")
        if num_micro_batches is not None and num_micro_batches != self.micro_batches:
            raise ValueError(f"eval_batch: num_micro_batches={num_micro_batches} differs from the schedule's "
                             f"{self.micro_batches} (gradient_accumulation_steps); leave it None")
        self.module.eval()
        losses: list[torch.Tensor] = []
        with self._guard.step("eval_batch"), torch.no_grad(), self._stage_gathered():
            args, kwargs, target = self._next_batch(data_iter)
            schedule = self._schedule_for(args, kwargs, target)
            outputs = schedule.eval(*args, target=target if compute_loss else None,
                                    losses=losses if compute_loss else None, **kwargs)
            # the monitor writes on global rank 0, a first-stage rank: it needs the loss too (as in DeepSpeed)
            bcast = bcast_loss or self.monitor.enabled
            loss = self._aggregate_loss(losses, reduce=reduce_output == "avg", bcast=bcast) if compute_loss else None
        self.module.train()
        if loss is not None and self.monitor.enabled:
            self.monitor.write_events([("Train/Samples/eval_loss", loss.mean().item(), self.global_samples)])
        if return_logits:
            return loss, (outputs if self.is_last_stage() else None)
        return loss

    # ---- checkpoints (hf_zero/checkpoint/pipeline.py) --------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective over every rank: per-layer model files plus each stage's (with tensor parallelism: each
        stage's TP ranks') ZeRO checkpoint; reloads on any number of stages, replicas, ZeRO stage and TP size."""
        from hf_zero.checkpoint.tags import resolve_save_tag

        tag = resolve_save_tag(tag, f"global_step{self.global_steps}", self._config.checkpoint.tag_validation)
        if self._config.checkpoint.use_node_local_storage:  # its per-layer files and 'latest' go to one directory
            raise NotImplementedError(
                "hf_zero: checkpoint.use_node_local_storage is not supported for pipeline checkpoints (the per-layer "
                "model files are written once, by the first replica): save them to a directory every node shares")
        if exclude_frozen_parameters:
            raise ValueError("pipeline checkpoints keep frozen parameters (they are needed to re-cut the stages)")
        from hf_zero.checkpoint.pipeline import save_pipeline_checkpoint

        return save_pipeline_checkpoint(self, save_dir, tag=tag, client_state=client_state,
                                        save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn=None):
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...) is not supported for pipeline checkpoints")
        if self._config.checkpoint.load_universal:
            raise NotImplementedError("hf_zero: checkpoint.load_universal with a pipeline engine: DeepSpeed universal "
                                      "checkpoints load into ZeRO engines only; hf_zero's pipeline checkpoints "
                                      "re-stage on load without it")
        from hf_zero.checkpoint.pipeline import load_pipeline_checkpoint

        return load_pipeline_checkpoint(self, load_dir, tag=tag,
                                        load_optimizer_states=load_optimizer_states and not load_module_only,
                                        load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
                                        load_module_strict=load_module_strict)

    # ---- internals ----------------------------------------------------------------------------------------------
    def _next_batch(self, data_iter):
        """The step's whole batch (micro-batches concatenated; the schedule splits it again) on the stages that
        read data; the other stages get nothing."""
        it = data_iter if data_iter is not None else self.data_iterator
        reads = self.is_first_stage() or self.is_last_stage() or self.module.data_on_every_stage
        micro = []
        if reads:
            if it is None:
                raise PipelineError("train_batch(): no data: pass data_iter, call set_dataiterator(), or give "
                                    "initialize(training_data=...)")
            for _ in range(self.micro_batches):
                batch = next(it)
                micro.append(self.batch_fn(batch) if self.batch_fn is not None else batch)
        args, kwargs, target, loss_fn = self.module.pipeline_batch(
            micro, first=self.is_first_stage(), last=self.is_last_stage(), num_microbatches=self.micro_batches,
            dp_group=self.grid.get_data_parallel_group(), dp_size=self.grid.data_parallel_size)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self._loss_fn = loss_fn if scale == 1.0 else (lambda out, tgt: loss_fn(out, tgt) * scale)
        return args, kwargs, target

    def _call_loss(self, output, target):
        return self._loss_fn(output, target)

    def _schedule_for(self, args, kwargs, target):
        """The schedule, rebuilt (shape inference again) when the batch's shapes change and the model allows it."""
        key = tuple(tuple(t.shape) for t in itertools.chain(args, kwargs.values(), [target])
                    if isinstance(t, torch.Tensor))
        if self._schedule is not None and key and self._shape_key and key != self._shape_key:
            if not (getattr(self.module, "dynamic_shape", False) or self.module.data_on_every_stage):
                raise PipelineError(f"the batch shapes changed from {self._shape_key} to {key} on pipeline stage "
                                    f"{self.stage_id}; pad to a fixed length, or build the PipelineModule with "
                                    f"dynamic_shape=True (or call engine.reset_activation_shape() on every stage)")
            self._schedule = None
        if getattr(self.module, "dynamic_shape", False) and not self.module.data_on_every_stage:
            self._schedule = None  # middle stages cannot see a change: re-infer every step, as DeepSpeed does
        if key:
            self._shape_key = key
        if self._schedule is None:
            after = self.stage3.finish_backward if self.stage3 is not None else None
            stages = [EngineStage(chunk, index, self.num_stages * self.module.virtual_stages, self.device,
                                  group=self.grid.get_pipe_parallel_group(), after_backward=after)
                      for index, chunk in self.module.chunk_modules()]
            self._schedule = build_schedule(self.pipeline_config.schedule, stages, self.micro_batches,
                                            loss_fn=self._call_loss)
        return self._schedule

    def _stage_gathered(self):
        """ZeRO-3: this stage's parameters stay gathered from the step's first forward to its last backward (the
        schedule runs several micro-batches' forwards before their backwards; gathering per module call would
        cost one all-gather per micro-batch and layer). Sharded at rest, gradients and optimizer state sharded
        throughout; the peak is one stage's full parameters, as FSDP's no-reshard-after-forward under PP."""
        if self.stage3 is None:
            return contextlib.nullcontext()
        from hf_zero.zero.gathered import GatheredParameters

        return GatheredParameters(list(self.module.parameters()))

    def _reduce_gradients(self) -> None:
        if self.reducer is not None:  # stages 0-2: one reduction of the accumulated gradients
            with self.timers.phase("backward"):
                self.reducer.begin(True)
                self.reducer.finish()
        for gi, tg in self._tied_index.items():
            if tg.group is not None:
                with self.timers.phase("communication"):
                    dist.all_reduce(self.groups[gi].grad, group=tg.group)

    def _sum_norm_and_loss(self, sq: torch.Tensor) -> torch.Tensor:
        """The optimizer's sum of the squared gradient norm over the stages; the step's loss rides along."""
        total = sum_over_stages(torch.stack([sq.float(), self._step_loss.float()]), self.grid)
        self._step_loss = total[1]
        return total[0].to(sq.dtype)

    def _local_loss(self, losses: list, reduce: bool = True) -> torch.Tensor:
        """Last stage: the micro-batch losses (pre-scaled) summed, averaged over the data-parallel replicas; zero
        on the other stages."""
        total = torch.zeros((), dtype=torch.float32)
        if self.is_last_stage():
            scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
            total = torch.stack([l.detach().float() for l in losses]).sum() / scale
            if reduce and self.grid.data_parallel_size > 1:
                dist.all_reduce(total, group=self._dp_loss_group)
                total /= self.grid.data_parallel_size
        return total

    def _broadcast_loss(self, total: torch.Tensor) -> torch.Tensor:
        """The last stage's loss sent to every stage of this replica."""
        if self.num_stages > 1:
            src = self.grid.stage_to_global(self.num_stages - 1)
            dist.broadcast(total, src=src, group=self.grid.get_pipe_parallel_group())
        return total

    def _aggregate_loss(self, losses: list, reduce: bool = True, bcast: bool = True) -> torch.Tensor:
        total = self._local_loss(losses, reduce=reduce)
        return self._broadcast_loss(total) if bcast else total
