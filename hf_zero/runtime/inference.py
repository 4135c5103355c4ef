"""``deepspeed.init_inference`` / ``InferenceEngine``: DeepSpeed 0.19.8's engine without kernel injection.

``init_inference(model, config=None, **kwargs)`` wraps ``model`` as DeepSpeed does for its non-injected path, in
this order:
  1. cast the model to ``dtype`` (DeepSpeed's default is fp16);
  2. move it to the accelerator's current device (``keep_module_on_host``: leave it where it is; a model on the meta
     device gets empty storage there);
  3. with ``tensor_parallel.tp_size > 1`` (or an ``mpu``), shard it with hf_zero's tensor parallelism
     (hf_zero.tensor_parallel, the machinery training uses) on a ``(dp, tp)`` mesh of the world; the LM head
     gathers full logits (``colwise_gather_output``), so every rank returns the whole model's output, as DeepSpeed's
     AutoTP does. ``injection_policy`` (``{layer class: (row-parallel linear names...)}``) is turned into a plan:
     the named linears row parallel, the layer's other linears column parallel, as DeepSpeed's policy does;
  4. with tensor parallelism, rank 0's RNG state is given to every rank, so sampling in ``generate`` draws the same
     tokens on all of them.
``engine(...)`` and ``engine.generate(...)`` are the model's; ``engine.module`` is the model.

Not here: DeepSpeed's fused inference kernels and CUDA graphs (speed only: warned), int8 and checkpoint loading
(refused by name, inference_config.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import torch
from torch import nn

from hf_zero import comm
from hf_zero.comm.accelerator import get_accelerator
from hf_zero.config.errors import ConfigError
from hf_zero.runtime.inference_config import InferenceConfig, merge_inference_config, parse_inference_config
from hf_zero.tensor_parallel import apply_tp, build_mesh, tp_info
from hf_zero.tensor_parallel.mesh import mesh_from_groups
from hf_zero.zero.stage3.param import is_sharded

__all__ = ["InferenceEngine", "init_inference"]

logger = logging.getLogger("hf_zero")


class InferenceEngine(nn.Module):
    """The model prepared for inference (see the module docstring); ``config``: an :class:`InferenceConfig` or
    DeepSpeed's config dict."""

    inference_mp_group = None  # DeepSpeed's class attributes, read by some scripts
    inference_ep_group = None
    expert_mp_group = None

    def __init__(self, model: nn.Module, config: InferenceConfig | Mapping[str, Any] | None = None):
        super().__init__()
        if not isinstance(config, InferenceConfig):
            config = parse_inference_config(config)
        _refuse_zero3_shards(model)
        self.module = model
        self._config = config
        # DeepSpeed's engine.config: the model's (HF) config, or the config's ``config`` entry when given
        self.config = config.config if config.config is not None else getattr(model, "config", None)
        if hasattr(model, "generate"):
            self.generate = self._generate
        self.injection_dict = config.injection_policy
        self.mpu = config.tensor_parallel.mpu
        self.mp_group = None
        self.ep_group = None
        self.expert_mp_group = None
        self.quantization_scales = None
        self.quantize_merge_count = 1
        self.cuda_graph_created = False
        self.local_cuda_graph = False
        self.model_profile_enabled = False
        self.use_cuda_events = False
        self._model_times: list[float] = []
        self._profile_hooks: list = []
        self._is_compiled = False

        self._convert_to_dtype(config.dtype)
        self._move_to_device(config.keep_module_on_host)
        self.tp_size = self._shard(config)
        if self.tp_size > 1:
            _share_rng_state()

    # ---- preparation ----------------------------------------------------------------------------------------------
    def _convert_to_dtype(self, dtype: torch.dtype) -> None:
        # as DeepSpeed: the whole module, buffers included (nn.Module.half / bfloat16 / float)
        {torch.float16: self.module.half, torch.bfloat16: self.module.bfloat16,
         torch.float32: self.module.float}[dtype]()

    def _move_to_device(self, keep_on_host: bool) -> None:
        device = get_accelerator().current_device_name()
        if getattr(self.module, "device", None) is not None and getattr(self.module.device, "type", None) == "meta":
            self.module.to_empty(device=device)
        elif not keep_on_host:
            self.module.to(device)

    def _shard(self, config: InferenceConfig) -> int:
        """Shard the model over the tensor-parallel ranks; the tensor-parallel size."""
        tp_cfg = config.tensor_parallel
        if tp_cfg.mpu is None and tp_cfg.tp_size == 1:
            if tp_info(self.module) is not None:
                raise ConfigError("tensor_parallel.tp_size", f"1, but the model is already sharded over "
                                                             f"{tp_info(self.module).size} ranks (training's tensor "
                                                             "parallelism); use that size")
            if config.injection_policy:
                _injection_plan(self.module, config.injection_policy)  # checked as DeepSpeed checks it
            return 1
        comm.init_distributed()  # as DeepSpeed's engine does, from the launcher's environment
        if tp_cfg.mpu is not None:
            mpu = tp_cfg.mpu
            layout = mesh_from_groups(mpu.get_data_parallel_group(), mpu.get_model_parallel_group(),
                                      source="tensor_parallel.mpu")
        else:
            layout = build_mesh(tp_cfg.tp_size, key="tensor_parallel.tp_size")
        self.mp_group = layout.tp_group
        existing = tp_info(self.module)
        if existing is not None:
            if existing.size != layout.tp_size:
                raise ConfigError("tensor_parallel.tp_size", f"{layout.tp_size}, but the model is already sharded "
                                                             f"over {existing.size} ranks (training's tensor "
                                                             "parallelism); use that size")
            if "vocab_lm_head" in existing.plan.values():
                raise ConfigError("tensor_parallel.tp_size", "the model was sharded for training with a "
                                                             "vocabulary-parallel LM head (its logits stay split "
                                                             "over the ranks); train with tensor_parallel."
                                                             "vocab_parallel_lm_head: false, or pass init_inference "
                                                             "an unsharded copy (hf_zero.tensor_parallel.state."
                                                             "full_state_dict)")
            return layout.tp_size
        if layout.tp_size == 1:
            return 1
        plan = _injection_plan(self.module, config.injection_policy) if config.injection_policy else None
        apply_tp(self.module, layout, plan=plan, vocab_parallel_head=False)
        return layout.tp_size

    # ---- running --------------------------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """The model's forward (CUDA graphs are not captured: ``enable_cuda_graph`` warned at construction)."""
        return self.module(*inputs, **kwargs)

    def _generate(self, *inputs, **kwargs):
        """``model.generate`` with DeepSpeed's checks: no beam search, inputs within ``max_out_tokens``."""
        if hasattr(self.module, "reset_cache"):
            self.module.reset_cache()
        num_beams = getattr(kwargs.get("generation_config"), "num_beams", 1)
        num_beams = kwargs.get("num_beams", num_beams)
        if num_beams is not None and num_beams > 1:
            raise NotImplementedError("DeepSpeed's InferenceEngine.generate refuses num_beams > 1 (DeepSpeed 0.19.8 "
                                      "does too); call engine.module.generate for beam search")
        ids = kwargs.get("input_ids")
        if ids is not None and ids.dim() == 2 and ids.shape[-1] > self._config.max_out_tokens:
            raise RuntimeError(f"Input with size {ids.shape[-1]} exceeds maximum length of "
                               f"{self._config.max_out_tokens}. Please increase max_tokens (max_out_tokens) in the "
                               "inference config.")
        return self.module.generate(*inputs, **kwargs)

    # ---- profiling ------------------------------------------------------------------------------------------------
    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Record each forward's wall time (ms), read and cleared by :meth:`model_times`. Timed with a device
        synchronize on both sides (``use_cuda_events`` is kept for DeepSpeed's signature; the times agree)."""
        if not self.model_profile_enabled:
            self._profile_hooks = [self.module.register_forward_pre_hook(self._pre_forward_hook),
                                   self.module.register_forward_hook(self._post_forward_hook)]
        self.model_profile_enabled = True
        self.use_cuda_events = use_cuda_events

    def _pre_forward_hook(self, module, inputs):
        get_accelerator().synchronize()
        self._start = time.perf_counter()

    def _post_forward_hook(self, module, inputs, output):
        get_accelerator().synchronize()
        self._model_times.append((time.perf_counter() - self._start) * 1e3)

    def model_times(self) -> list[float]:
        """The forward times (ms) since the last call; clears them."""
        assert self.model_profile_enabled, "model profiling is not enabled"
        times, self._model_times = self._model_times, []
        return times

    # ---- the rest of DeepSpeed's surface --------------------------------------------------------------------------
    def compile(self, backend: str | None = None, compile_kwargs: Mapping[str, Any] | None = None) -> None:
        """``torch.compile`` the model in place (once)."""
        if self._is_compiled:
            return
        self.module.compile(backend=backend or get_accelerator().get_compile_backend(), **dict(compile_kwargs or {}))
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    def destroy(self) -> None:
        """DeepSpeed frees its kernels' workspace here; hf_zero has none."""


def init_inference(model: nn.Module, config: str | Mapping[str, Any] | None = None, **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's ``init_inference``: ``config`` (a dict or a JSON file's path) and keyword arguments merged (a key
    in both must agree), parsed (inference_config.py), and ``model`` wrapped in an :class:`InferenceEngine`."""
    if not comm.is_initialized() or comm.get_rank() == 0:
        logger.info("hf_zero: init_inference (DeepSpeed's InferenceEngine without kernel injection)")
    return InferenceEngine(model, parse_inference_config(merge_inference_config(config, kwargs)))


def _refuse_zero3_shards(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if is_sharded(p):
            raise ValueError(f"hf_zero: init_inference got a model whose parameters are ZeRO-3 partitions "
                             f"({name!r} holds 1/world of its values); pass a model with full weights: save with "
                             "engine.save_16bit_model and load it, or build the inference model outside zero.Init")


def _injection_plan(model: nn.Module, policy: Mapping[Any, Any]) -> dict[str, str]:
    """DeepSpeed's ``injection_policy`` as an apply_tp plan: inside every module of a policy's class, the linears the
    policy names are row parallel (their outputs summed over the ranks) and its other linears column parallel."""
    names = [n for n, _ in model.named_modules()]
    plan: dict[str, str] = {}
    for cls, rowwise in policy.items():
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ConfigError("injection_policy", f"{cls!r} is not a subclass of torch.nn.Module")
        rowwise = (rowwise,) if isinstance(rowwise, str) else tuple(rowwise)
        for suffix in rowwise:
            if not any(n.endswith(suffix) for n in names):
                raise ConfigError("injection_policy", f"layer {suffix!r} is not a module of "
                                                      f"{type(model).__name__} (Injection policy layer not valid)")
        for owner, module in model.named_modules():
            if not isinstance(module, cls):
                continue
            for child, sub in module.named_modules():
                linear = isinstance(sub, nn.Linear) or (type(sub).__name__ == "Conv1D" and hasattr(sub, "nf"))
                if child and linear:
                    plan[f"{owner}.{child}" if owner else child] = \
                        "rowwise" if any(child.endswith(s) for s in rowwise) else "colwise"
    return plan


def _share_rng_state() -> None:
    """Every rank continues from global rank 0's RNG state (DeepSpeed broadcasts it too)."""
    import torch.distributed as dist

    acc = get_accelerator()
    state = [acc.get_rng_state()]
    dist.broadcast_object_list(state, src=0)
    acc.set_rng_state(state[0].cpu())
