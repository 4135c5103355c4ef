"""The rest of DeepSpeed's engine surface that training scripts call, on :class:`~hf_zero.runtime.engine.HfZeroEngine`.

The engine module holds the training loop (forward, backward, step, checkpoints); this mixin holds what DeepSpeed's
``DeepSpeedEngine`` also answers and scripts read around that loop, each as DeepSpeed 0.19.8 answers it (probed
side by side on the same scripts, ``DS_ACCELERATOR=cpu``):

* attribute pass-through to the wrapped model (``engine.generate(...)``, ``engine.gradient_checkpointing_enable()``,
  ``engine.config_class`` ...): DeepSpeed's ``__getattr__`` falls back to ``engine.module``;
* the config as getters (``gradient_clipping()``, ``zero_reduce_bucket_size()``, ``optimizer_name()``,
  ``curriculum_params_legacy()`` ...);
* the run's layout (``dp_world_size``, ``mp_world_size``, ``mpu``, ``data_parallel_group``);
* ``was_step_applied()``, ``get_mom()``, ``no_sync()``, ``coalesce_grad_reduction()``, ``set_train_batch_size()`` /
  ``set_train_micro_batch_size()``, ``save_fp16_model()``;
* ``load_module_state_dict()``, whose masters follow the load (hf_zero/runtime/module_load.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import torch

from hf_zero.config.errors import ConfigAssertionError, ConfigError
from hf_zero.runtime.ds_config_getters import DeepSpeedConfigGetters
from hf_zero.runtime.errors import UsageError

__all__ = ["DeepSpeedEngineAPI"]


class DeepSpeedEngineAPI(DeepSpeedConfigGetters):
    """Mixed into HfZeroEngine (an ``nn.Module``); reads the engine's ``_config``, ``optimizer``, ``module``."""

    # ---- the wrapped model's attributes ---------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # nn.Module's lookup first (parameters, buffers, submodules -- ``module`` itself is one), then the wrapped
        # model's, as DeepSpeed's engine does: scripts call engine.generate(), engine.get_input_embeddings(), ...
        # Python calls this when one of the engine's properties raised AttributeError: that error is the answer
        # (e.g. flops_profiler's, naming the config key), not the wrapped model's lack of the name.
        prop = getattr(type(self), name, None)
        if isinstance(prop, property):
            return prop.fget(self)
        try:
            return super().__getattr__(name)
        except AttributeError as missing:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise missing from None

    # ---- the config, as DeepSpeed's getters -----------------------------------------------------------------------
    def gradient_clipping(self) -> float:
        return float(self._config.gradient_clipping)

    def optimizer_name(self) -> str | None:
        return self._config.optimizer.type.lower() if self._config.optimizer is not None else None

    def optimizer_params(self) -> dict | None:
        """The section's ``params`` as the user wrote them (the resolved config's dict, "auto" filled)."""
        return (self._config.raw.get("optimizer") or {}).get("params") if self._config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self._config.scheduler.type if self._config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return (self._config.raw.get("scheduler") or {}).get("params") if self._config.scheduler is not None else None

    def managed_gradient_accumulation(self) -> bool:
        return bool(self._config.managed_gradient_accumulation)

    def collect_python_gc(self) -> int:
        """DeepSpeed's: one full cyclic garbage collection now (for ``disable_python_gc`` runs, at a point the
        script chooses); returns the number of unreachable objects found."""
        from hf_zero.runtime.python_gc import python_gc

        return python_gc.collect()

    def log_level(self) -> str | None:
        """The config's ``log_level`` as written (None: unset), as DeepSpeed's getter."""
        return self._config.log_level

    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self._config.wall_clock_breakdown)

    def dump_state(self) -> bool:
        return bool(self._config.dump_state)

    def memory_breakdown(self) -> bool:
        return bool(self._config.memory_breakdown)

    def fp16_auto_cast(self) -> bool:
        return bool(self._config.fp16.auto_cast)

    def curriculum_enabled_legacy(self) -> bool:
        return self._config.curriculum_learning.enabled

    def curriculum_params_legacy(self) -> dict:
        """The ``curriculum_learning`` section as written, without ``enabled`` (DeepSpeed's getter)."""
        params = dict(self._config.raw.get("curriculum_learning") or {})
        params.pop("enabled", None)
        return params

    def pld_enabled(self) -> bool:
        return self._config.progressive_layer_drop.enabled

    def pld_params(self) -> dict | bool:
        """The ``progressive_layer_drop`` section without ``enabled``, False without it (DeepSpeed's getter)."""
        section = self._config.raw.get("progressive_layer_drop")
        if section is None:
            return False
        pld = self._config.progressive_layer_drop
        return {**{k: v for k, v in section.items() if k != "enabled"}, "theta": pld.theta, "gamma": pld.gamma}

    def pld_theta(self) -> float:
        return self._config.progressive_layer_drop.theta

    def pld_gamma(self) -> float:
        return self._config.progressive_layer_drop.gamma

    def get_pld_theta(self) -> float | None:
        """The keep probability the next training forward gets; None without PLD."""
        return self.progressive_layer_drop.get_theta() if self.progressive_layer_drop is not None else None

    # ---- flops_profiler (hf_zero/profiling/step_profile.py) -------------------------------------------------------
    @property
    def flops_profiler(self):
        """DeepSpeed's ``engine.flops_profiler``: with the section enabled, the profiler of the profiled step, whose
        ``flops`` / ``macs`` / ``params`` and ``get_total_*()`` are read after that step; absent otherwise, as in
        DeepSpeed (an AttributeError naming the key)."""
        profiler = self.__dict__.get("step_profiler")
        if profiler is None or not profiler.enabled:
            raise AttributeError("engine.flops_profiler exists when the config's flops_profiler.enabled is true "
                                 "(as in DeepSpeed)")
        return profiler

    def flops_profiler_enabled(self) -> bool:
        return bool(self._config.flops_profiler.enabled)

    def flops_profiler_profile_step(self) -> int:
        return int(self._config.flops_profiler.profile_step)

    def flops_profiler_module_depth(self) -> int:
        return int(self._config.flops_profiler.module_depth)

    def flops_profiler_top_modules(self) -> int:
        return int(self._config.flops_profiler.top_modules)

    def flops_profiler_detailed(self) -> bool:
        return bool(self._config.flops_profiler.detailed)

    def flops_profiler_output_file(self) -> str | None:
        return self._config.flops_profiler.output_file

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return float(self._config.flops_profiler.recompute_fwd_factor)

    def random_ltd_enabled(self) -> bool:
        return self.random_ltd_scheduler is not None

    def random_ltd_config(self) -> dict:
        """``data_efficiency.data_routing.random_ltd`` as written (DeepSpeed's getter)."""
        return dict((self.data_efficiency_config().get("data_routing") or {}).get("random_ltd") or {})

    def random_ltd_initialize(self) -> None:
        """Hand the schedule to the configured layers among those convert_to_random_ltd wrapped: the i-th id of
        ``random_ltd_layer_id`` (sorted) goes to the first wrapper, in module order, whose name contains it after
        the previous one -- DeepSpeed's matching -- and they must all be found."""
        from hf_zero.runtime.random_ltd import RandomLayerTokenDrop

        if self.random_ltd_scheduler is None:
            raise ConfigError("data_efficiency.data_routing.random_ltd.enabled", "random_ltd_initialize() needs the "
                                                                                "random-LTD section enabled")
        queue = list(self.random_ltd_scheduler.policy.layer_ids)
        found = 0
        for name, layer in self.module.named_modules():
            if isinstance(layer, RandomLayerTokenDrop) and queue and str(queue[0]) in name:
                layer.init_config(self.random_ltd_scheduler, found)
                queue.pop(0)
                found += 1
        if queue:
            raise ConfigError("data_efficiency.data_routing.random_ltd.random_ltd_layer_id",
                              f"no wrapped layer found for ids {queue} (wrapped layers are matched in module order by "
                              "the id in their name, as DeepSpeed does); wrap them with convert_to_random_ltd first")

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return float(self._config.gradient_predivide_factor)

    def loss_scale(self) -> float:
        """The fp16 section's static ``loss_scale`` (0: dynamic), as DeepSpeed's getter; the scale in use is
        :meth:`get_loss_scale`."""
        return float(self._config.fp16.loss_scale) if self._config.fp16.enabled is True else 0.0

    def communication_data_type(self) -> torch.dtype:
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        chosen = self._config.communication_data_type
        return names[chosen] if chosen is not None else self.compute_dtype

    def zero_offload_optimizer(self):
        """The ``offload_optimizer`` section when it offloads, else None (DeepSpeed: its config object or None)."""
        section = self._config.zero.offload_optimizer
        return section if self.zero_policy.offload_optimizer is not None else None

    def zero_offload_param(self):
        section = self._config.zero.offload_param
        return section if self.zero_policy.offload_param is not None else None

    def zero_cpu_offload(self) -> bool:
        off = self.zero_policy.offload_optimizer
        return off is not None and off.device == "cpu"

    def zero_reduce_scatter(self) -> bool:
        return bool(self._config.zero.reduce_scatter)

    def zero_overlap_comm(self) -> bool:
        return bool(self.zero_policy.overlap_comm)

    def zero_contiguous_gradients(self) -> bool:
        return bool(self._config.zero.contiguous_gradients)

    def zero_reduce_bucket_size(self) -> int:
        return int(self.zero_policy.reduce_bucket_numel)

    def zero_allgather_bucket_size(self) -> int:
        return int(self.zero_policy.allgather_bucket_numel)

    # ---- the layout -----------------------------------------------------------------------------------------------
    @property
    def dp_world_size(self) -> int:
        return self.world_size

    @property
    def mp_world_size(self) -> int:
        """Ranks holding other parts of one model replica (tensor / pipeline parallel); 1 without."""
        group = self.model_parallel_group
        return torch.distributed.get_world_size(group) if group is not None else 1

    @property
    def checkpoint_mp_rank(self) -> int:
        """DeepSpeed's: the model-parallel rank its checkpoint file names carry (``mp_rank_XX``); 0 without model
        parallelism (an mpu of sequence parallelism alone included)."""
        group = self.model_parallel_group
        return torch.distributed.get_rank(group) if group is not None and self.mp_world_size > 1 else 0

    @property
    def data_parallel_group(self):
        return self.process_group if self.process_group is not None else torch.distributed.group.WORLD

    @property
    def mpu(self):
        """The ``mpu`` given to initialize (None without), as DeepSpeed keeps it."""
        return self.__dict__.get("_mpu")

    # ---- the step -------------------------------------------------------------------------------------------------
    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` updated the parameters (DeepSpeed's): False before any, for a step()
        between accumulation boundaries, and for one an fp16 overflow skipped."""
        return self._step_applied

    def get_mom(self) -> list:
        """Each group's momentum: Adam's ``betas``, SGD's ``momentum`` (DeepSpeed's getter)."""
        if self.optimizer is None:
            return []
        return [list(g["betas"]) if "betas" in g else g.get("momentum") for g in self.optimizer.param_groups]

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: between steps, give back the memory of every gathered ZeRO-3 parameter (a forward under
        ``no_grad`` that was not followed by a backward, a prefetch, and the persistent ones, gathered again by the
        next forward), as before an inference engine loads. Nothing to do at stages 0-2. Not inside a forward or
        backward."""
        stage3 = getattr(self, "stage3", None)
        if stage3 is None:
            return
        if stage3.states.any_open():
            raise RuntimeError("hf_zero: engine.empty_partition_cache() inside the model's forward or backward; call "
                               "it between steps")
        stage3.release_gathered()

    def allreduce_gradients(self, bucket_size=None) -> None:
        """DeepSpeed's: reduce the gradients backward passes left on this rank. Its backward calls it at the
        accumulation boundary, and so does hf_zero's, so there it finds nothing left; called between boundaries
        (stages 0/1, where gradients are reduced only at the boundary) it reduces what the passes so far summed,
        and the boundary's reduction adds the rest. ``bucket_size`` is DeepSpeed's buffer size: hf_zero's buckets
        are ``reduce_bucket_size``, so a value given is warned about (same gradients). Stages 2/3 reduce in every
        backward: nothing to do. Refused inside ``no_sync()`` / ``coalesce_grad_reduction()``, whose point is not to
        reduce yet."""
        if self.optimizer is None:
            self._no_optimizer()
        if bucket_size is not None:
            warnings.warn(f"hf_zero: engine.allreduce_gradients(bucket_size={bucket_size}) has no effect: the "
                          "reduction's buckets are zero_optimization.reduce_bucket_size (same gradients)",
                          stacklevel=2)
        block = self._gradient_block()
        if block is not None:
            raise UsageError(f"hf_zero: engine.allreduce_gradients() inside engine.{block}(): the block holds the "
                             "gradients back until it ends; call it after the with-block")
        if self.reducer is not None and self.stage < 2:
            self._reduce_held_gradients()

    def _gradient_block(self) -> str | None:
        """The block holding this rank's gradients back (``no_sync`` / ``coalesce_grad_reduction``), if one is open:
        what step() and allreduce_gradients() refuse to run inside."""
        return "coalesce_grad_reduction" if self._coalescing else "no_sync" if self._inside_no_sync else None

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside reduce no gradients: they accumulate on this rank until a backward outside (as
        DDP's ``no_sync``, and DeepSpeed's, which refuses it where gradients are partitioned: stages 2 and 3)."""
        if self._coalescing:
            raise UsageError("hf_zero: engine.no_sync() inside engine.coalesce_grad_reduction(): the block already "
                             "holds every gradient back until it ends; use one of the two")
        if self.stage >= 2:
            raise ConfigAssertionError("zero_optimization.stage",
                                       f"{self.stage}: engine.no_sync() keeps unreduced gradients on each rank, which "
                                       "ZeRO stages 2 and 3 partition as they arrive (DeepSpeed refuses it too); use "
                                       "stage 0 or 1")
        previous, self._inside_no_sync = self._inside_no_sync, True
        try:
            yield
        finally:
            self._inside_no_sync = previous

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """DeepSpeed's: the backward passes inside leave their gradients summed on this rank, and leaving the block
        reduces them in one pass (one set of collectives for several backward passes, at the cost of holding full
        gradients meanwhile); the next ``step()`` applies them. One block holds one optimizer step's gradients:
        ``step()`` inside, and nesting with ``no_sync()``, are refused. Stages 0-3 (DeepSpeed: 1-3; stage 0's
        all-reduce coalesces the same way); not under pipeline parallelism, where ``train_batch`` owns backward.
        If the block raises, nothing is reduced (the other ranks would wait on this one): the held gradients are
        dropped with the exception."""
        if self.pipeline_parallelism:
            raise NotImplementedError("hf_zero: coalesce_grad_reduction is not supported under pipeline parallelism: "
                                      "train_batch() runs every backward pass of the step itself (as in DeepSpeed)")
        if self.optimizer is None:
            self._no_optimizer()
        if not self._managed_gas:
            raise ConfigAssertionError("managed_gradient_accumulation",
                                       "false, and coalesce_grad_reduction() was entered: step() reduces the "
                                       "gradients of every backward since the last step already (DeepSpeed refuses "
                                       "the pair too)")
        if self._inside_no_sync or self._coalescing:
            raise UsageError("hf_zero: engine.coalesce_grad_reduction() nested inside engine.no_sync() or another "
                             "coalesce_grad_reduction(); use one block per optimizer step")
        self._coalescing = True
        if self.stage3 is not None:
            self.stage3.hold_gradients()
        try:
            yield
        except BaseException:
            self._coalescing = False
            if self.stage3 is not None:
                self.stage3.drop_held_gradients()
            else:
                self.optimizer.zero_grad()  # the block's gradients, held in param.grad
            raise
        self._coalescing = False
        if self.stage3 is not None:
            self.stage3.reduce_held_gradients()
        else:
            self._reduce_held_gradients()  # the gradients the block's passes left in param.grad

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """A new global batch with the same micro-batch: the accumulation steps change (DeepSpeed's rule)."""
        micro, world = self.train_micro_batch_size_per_gpu(), self._config.world_size
        if train_batch_size % (micro * world) != 0:
            raise ValueError(f"hf_zero: train_batch_size {train_batch_size} is not divisible by micro-batch {micro} "
                             f"x data-parallel ranks {world}")
        self._set_batch(train_batch_size, micro, train_batch_size // (micro * world))

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """A new micro-batch with the same accumulation steps: the global batch changes (DeepSpeed's rule)."""
        gas, world = self.gradient_accumulation_steps(), self._config.world_size
        self._set_batch(micro_batch_size * gas * world, micro_batch_size, gas)

    def _set_batch(self, train: int, micro: int, gas: int) -> None:
        raw = dict(self._config.raw)
        raw.update(train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
        self._config = dataclasses.replace(self._config, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                                           gradient_accumulation_steps=gas, raw=raw)

    # ---- weights --------------------------------------------------------------------------------------------------
    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def load_module_state_dict(self, checkpoint, strict: bool = True, custom_load_fn=None,
                               fetch_z3_params: bool = False, z3_params_to_fetch=None,
                               allowed_missing_keys=None) -> None:
        """Load ``checkpoint['module']`` (a state dict, the same on every rank) into the engine's model; call on
        every rank. DeepSpeed's arguments: ``custom_load_fn(src=state_dict, dst=module)`` replaces the load;
        ``strict`` as torch's, except that with ``allowed_missing_keys`` a strict load may miss exactly those keys
        (anything else missing, or any unexpected key, raises RuntimeError); ``fetch_z3_params`` /
        ``z3_params_to_fetch`` gather those ZeRO-3 parameters around ``custom_load_fn`` (rank 0's edits are kept).
        ``checkpoint['frozen_param_fragments']``, when present, sets the frozen parameters, as DeepSpeed.

        Differs from DeepSpeed: the optimizer's fp32 master weights and 16-bit shards are set from the loaded
        weights too, at every ZeRO stage (0-3, optimizer offload included), so the next ``step`` starts from the
        loaded weights. DeepSpeed leaves its masters as they were (its ``load_checkpoint`` refreshes them
        separately), so there the next step silently reverts the load. At ZeRO-3 the state dict is loaded
        parameter by parameter, gathering nothing, after checking every key and shape first (a refused load
        changes nothing); the model's ``load_state_dict`` hooks do not run there (use ``custom_load_fn``).
        A tensor-parallel model is refused (use ``load_checkpoint``). See hf_zero/runtime/module_load.py."""
        from hf_zero.runtime.module_load import load_module_state_dict

        load_module_state_dict(self, checkpoint, strict=strict, custom_load_fn=custom_load_fn,
                               fetch_z3_params=fetch_z3_params, z3_params_to_fetch=z3_params_to_fetch,
                               allowed_missing_keys=allowed_missing_keys)
