"""Layer reduction: initialize a shallower student from chosen teacher layers (DeepSpeed's
``student_initialization``), plus :func:`make_student`, which builds that student from a transformers teacher."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from hf_zero.config.errors import ConfigError

from .config import LayerReductionConfig

__all__ = ["student_initialization", "make_student", "find_layer_list", "default_teacher_layers"]

_PATH = "compression_training.layer_reduction"


def find_layer_list(model: nn.Module, prefix: str | None = None) -> tuple[str, nn.ModuleList]:
    """The transformer block list: ``prefix`` if given, else the longest ``nn.ModuleList`` in the model."""
    if prefix:
        try:
            layers = model.get_submodule(prefix)
        except AttributeError:
            raise ConfigError(f"{_PATH}.module_name_prefix", f"{prefix!r} is not a module of "
                                                             f"{type(model).__name__}") from None
        if not isinstance(layers, nn.ModuleList):
            raise ConfigError(f"{_PATH}.module_name_prefix", f"{prefix!r} is a {type(layers).__name__}, "
                                                             f"not the nn.ModuleList of layers")
        return prefix, layers
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ConfigError(f"{_PATH}.module_name_prefix", f"{type(model).__name__} has no nn.ModuleList of layers; "
                                                         f"name it")
    return max(lists, key=lambda nm: len(nm[1]))


def default_teacher_layers(teacher_layers: int, keep: int) -> tuple[int, ...]:
    """Evenly spaced, ending with the last layer: 4 -> 2 keeps (1, 3); 12 -> 4 keeps (2, 5, 8, 11)."""
    return tuple(round((i + 1) * teacher_layers / keep) - 1 for i in range(keep))


@torch.no_grad()
def student_initialization(student: nn.Module, teacher: nn.Module, cfg: LayerReductionConfig | dict) -> nn.Module:
    """Copy teacher layer ``teacher_layer[i]`` into student layer ``i`` and every other module (embeddings, final
    norm, head -- or exactly ``other_module_name``) from the teacher. In place; returns the student."""
    if not isinstance(cfg, LayerReductionConfig):
        from hf_zero.config.schema import parse

        cfg = parse(LayerReductionConfig, dict(cfg), _PATH)
    prefix, s_layers = find_layer_list(student, cfg.module_name_prefix)
    _, t_layers = find_layer_list(teacher, cfg.module_name_prefix or prefix)
    keep = cfg.keep_number_layer or len(s_layers)
    if len(s_layers) != keep:
        raise ConfigError(f"{_PATH}.keep_number_layer", f"is {keep} but the student has {len(s_layers)} layers "
                                                        f"under {prefix}; build it with {keep} (see make_student)")
    chosen = cfg.teacher_layer or default_teacher_layers(len(t_layers), keep)
    for i in chosen:
        if i >= len(t_layers):
            raise ConfigError(f"{_PATH}.teacher_layer", f"index {i} is out of range: the teacher has "
                                                        f"{len(t_layers)} layers")
    for s_idx, t_idx in enumerate(chosen):
        s_layers[s_idx].load_state_dict(t_layers[t_idx].state_dict())
    t_state = teacher.state_dict()
    s_state = student.state_dict()
    if cfg.other_module_name:
        wanted = [k for k in s_state if any(k == m or k.startswith(m + ".") for m in cfg.other_module_name)]
        for i, m in enumerate(cfg.other_module_name):
            if not any(k == m or k.startswith(m + ".") for k in s_state):
                raise ConfigError(f"{_PATH}.other_module_name[{i}]", f"{m!r} is not a module of the student")
    else:
        wanted = [k for k in s_state if not k.startswith(prefix + ".")]
    for key in wanted:
        if key not in t_state or t_state[key].shape != s_state[key].shape:
            raise ConfigError(f"{_PATH}.other_module_name", f"student tensor {key} has no same-shaped teacher "
                                                            f"tensor to copy")
        s_state[key].copy_(t_state[key])
    return student


def make_student(teacher: nn.Module, keep_number_layer: int, teacher_layer: tuple[int, ...] = (),
                 **config_overrides: Any) -> nn.Module:
    """A transformers model like ``teacher`` with ``keep_number_layer`` layers, initialized by
    :func:`student_initialization`. ``config.layer_types`` (per-layer attention kinds) follows the chosen layers."""
    config = copy.deepcopy(teacher.config)
    n_teacher = config.num_hidden_layers
    chosen = tuple(teacher_layer) or default_teacher_layers(n_teacher, keep_number_layer)
    config.num_hidden_layers = keep_number_layer
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == n_teacher:
        config.layer_types = [layer_types[i] for i in chosen]
    for key, value in config_overrides.items():
        setattr(config, key, value)
    student = type(teacher)(config).to(next(teacher.parameters()).device)
    cfg = LayerReductionConfig(enabled=True, keep_number_layer=keep_number_layer, teacher_layer=chosen)
    return student_initialization(student, teacher, cfg)
