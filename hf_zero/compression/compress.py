"""``init_compression`` / ``redundancy_clean`` (DeepSpeed's names and meaning) and the step scheduler.

    model = init_compression(model, ds_config)            # compression inserted, trained with the model
    scheduler = CompressionScheduler(model)                # scheduler.step(global_step) each optimizer step
    ...train...
    model = redundancy_clean(model, ds_config)            # folded and physically smaller; a plain HF model

Fixed order inside ``init_compression``: (1) layer reduction (the student's layers are copied from the teacher, so
it must come before anything wraps them); (2) every enabled grouped method, in ``GROUPED_METHODS`` order; within a
module, masks apply before the weight quantizer (see ``layer.TRANSFORM_ORDER``); (3) every schedule set to step 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .config import SECTION, CompressionConfig, parse_compression_config
from .layer import (CompressedLinear, InputTransform, WeightTransform, compressed_modules, full_parameters,
                    require_full_parameters, unwrap_all)
from .registry import CleanPlan, Slice, get_method

__all__ = ["init_compression", "redundancy_clean", "CompressionScheduler", "load_compression_config",
           "weight_sparsity"]


def load_compression_config(config: Any) -> CompressionConfig:
    """A parsed config from: a CompressionConfig; a whole DeepSpeed config (dict or JSON path) holding a
    ``compression_training`` section; or that section alone."""
    if isinstance(config, CompressionConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if config is None:
        return CompressionConfig()
    if isinstance(config, Mapping) and SECTION in config:
        return parse_compression_config(config[SECTION])
    return parse_compression_config(config)


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None,
                     mpu: Any = None) -> nn.Module:
    """Insert the configured compression into ``model`` (in place; also returned). Call it before the optimizer
    is built: ``topk`` pruning adds learnable scores. ``teacher_model`` is needed for ``layer_reduction``."""
    cfg = load_compression_config(deepspeed_config)
    if cfg.layer_reduction is not None and cfg.layer_reduction.enabled:
        from .layer_reduction.apply import student_initialization

        if teacher_model is None:
            from hf_zero.config.errors import ConfigError

            raise ConfigError(f"{SECTION}.layer_reduction", "enabled, so init_compression needs teacher_model= "
                                                            "(the model whose layers initialize the student)")
        student_initialization(model, teacher_model, cfg.layer_reduction)
    for method_cfg in cfg.enabled_methods():
        get_method(method_cfg.method).install(model, method_cfg)
    CompressionScheduler(model).step(0)
    return model


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Make the compression permanent: fold every mask and quantizer into the weights, physically remove pruned
    rows / heads, put plain ``nn.Linear`` modules back and update the transformers config to the new sizes.
    Fake activation quantizers are dropped (see :func:`hf_zero.compression.export.export_int8`)."""
    cfg = load_compression_config(deepspeed_config)
    require_full_parameters(model, "redundancy_clean")
    plans: list[CleanPlan] = []
    for method_cfg in cfg.enabled_methods():
        method = get_method(method_cfg.method)
        if method.plan_clean is not None:
            plans.append(method.plan_clean(model, method_cfg))
    with torch.no_grad():
        for module in compressed_modules(model).values():
            weight, bias = module.folded()
            module.weight.copy_(weight)  # in place: tied weights and parameter identity survive
            if bias is not None:
                module.bias.copy_(bias)
    unwrap_all(model)
    for plan in plans:
        for s in plan.slices:
            _slice_linear(model, s)
        for action in plan.extra:
            action(model)
        for owner, attr, value in plan.updates:
            target = model.config if owner == "config" else (model.get_submodule(owner) if owner else model)
            setattr(target, attr, value)
    return model


def _slice_linear(model: nn.Module, s: Slice) -> None:
    module = model.get_submodule(s.module)
    index = s.index.to(module.weight.device)
    weight = module.weight.detach().index_select(s.dim, index).clone()
    bias = module.bias
    if bias is not None:
        bias = bias.detach().index_select(0, index).clone() if s.dim == 0 else bias.detach().clone()
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    new.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    if bias is not None:
        new.bias = nn.Parameter(bias, requires_grad=module.bias.requires_grad)
    parent_name, _, child = s.module.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


class CompressionScheduler:
    """Moves every transform in ``model`` to a global step. Stateless apart from the last step: all schedule
    state lives in the model's buffers, so a scheduler rebuilt after resume continues exactly."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.training_steps = 0

    def transforms(self) -> list[tuple[str, str, nn.Module]]:
        out = []
        for name, module in compressed_modules(self.model).items():
            for method, t in module.weight_transforms.items():
                out.append((name, method, t))
            for method, t in module.input_transforms.items():
                out.append((name, method, t))
        return out

    def step(self, step: int | None = None) -> None:
        """Set every schedule to ``step`` (default: one more than last time)."""
        self.training_steps = self.training_steps + 1 if step is None else int(step)
        for _, _, t in self.transforms():
            assert isinstance(t, (WeightTransform, InputTransform))
            t.set_step(self.training_steps)

    def stats(self) -> dict[str, float]:
        """Loggable numbers: per method, mean current bits or kept share; plus measured weight sparsity."""
        sums: dict[str, list[float]] = {}
        for _, method, t in self.transforms():
            for key, value in t.stats().items():
                sums.setdefault(f"compression/{method}/{key}", []).append(value)
        out = {k: sum(v) / len(v) for k, v in sums.items()}
        out["compression/linear_weight_sparsity"] = weight_sparsity(self.model)
        return out


@torch.no_grad()
def weight_sparsity(model: nn.Module) -> float:
    """Share of exact zeros in the effective weights of every linear layer (what the model computes with)."""
    zeros = total = 0
    for module in model.modules():
        if isinstance(module, CompressedLinear):
            weight, _ = module.folded()
        elif isinstance(module, nn.Linear):
            with full_parameters([module.weight]):
                weight = module.weight.detach().clone()
        else:
            continue
        zeros += int((weight == 0).sum())
        total += weight.numel()
    return zeros / max(total, 1)
