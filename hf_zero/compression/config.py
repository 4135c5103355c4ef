"""The ``compression_training`` section of a DeepSpeed-format config, parsed once into frozen dataclasses.

Layout (DeepSpeed's)::

    "compression_training": {
      "weight_quantization": {
        "shared_parameters": {"enabled": true, "schedule_offset": 0, "quantization_type": "symmetric", ...},
        "different_groups": {
          "wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0},
                  "modules": ["self_attn", "mlp"]}
        }
      },
      "activation_quantization": {...}, "sparse_pruning": {...}, "row_pruning": {...},
      "head_pruning": {...}, "channel_pruning": {...},
      "layer_reduction": {"enabled": true, "keep_number_layer": 2, "module_name_prefix": "model.layers",
                          "teacher_layer": [1, 3], "other_module_name": [...]}
    }

Each method's ``shared_parameters`` / ``params`` classes live in the method's folder (``<method>/config.py``; the
pruning methods' derive from :mod:`hf_zero.compression.pruning_config`) and check themselves in ``validate``;
this module only walks the section, so an unknown method, key or group shape is a :class:`ConfigError` with the
full key path. Checks that need the model (a module pattern that matches nothing, a ratio that would remove every
head) are made by :func:`hf_zero.compression.init_compression`, with the same key paths.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from hf_zero.config.errors import ConfigError, check_keys, unknown_key
from hf_zero.config.schema import parse, spec

from .activation_quantization.config import ActivationQuantizationParams, ActivationQuantizationShared
from .channel_pruning.config import ChannelPruningParams, ChannelPruningShared
from .head_pruning.config import HeadPruningParams, HeadPruningShared
from .layer_reduction.config import LayerReductionConfig
from .row_pruning.config import RowPruningParams, RowPruningShared
from .sparse_pruning.config import SparsePruningParams, SparsePruningShared
from .weight_quantization.config import WeightQuantizationParams, WeightQuantizationShared

__all__ = ["CompressionConfig", "MethodConfig", "Group", "parse_compression_config", "GROUPED_METHODS",
           "SECTION"]

SECTION = "compression_training"

S = TypeVar("S")
P = TypeVar("P")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group(Generic[P]):
    """One entry of ``different_groups``: which modules (regex, ``re.search`` on the full module name; ``"*"``
    for every eligible module) get which ``params``. ``related_modules`` names, per matched module, the modules
    whose input side shrinks with it (row / head / channel pruning)."""

    name: str
    params: P
    modules: tuple[str, ...]
    related_modules: tuple[str, ...] = ()
    path: str = ""  # key path of this group in the user's config, for errors raised against the model


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodConfig(Generic[S, P]):
    """``shared_parameters`` plus the parsed ``different_groups`` of one method."""

    method: str
    shared: S
    groups: tuple[Group[P], ...]
    path: str

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.shared, "enabled", False)) and bool(self.groups)


# method name -> (shared_parameters class, params class, related_modules required)
GROUPED_METHODS: dict[str, tuple[type, type, bool]] = {
    "weight_quantization": (WeightQuantizationShared, WeightQuantizationParams, False),
    "activation_quantization": (ActivationQuantizationShared, ActivationQuantizationParams, False),
    "sparse_pruning": (SparsePruningShared, SparsePruningParams, False),
    "row_pruning": (RowPruningShared, RowPruningParams, True),
    "head_pruning": (HeadPruningShared, HeadPruningParams, True),
    "channel_pruning": (ChannelPruningShared, ChannelPruningParams, False),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """The whole ``compression_training`` section. A method left out of the JSON is ``None``."""

    weight_quantization: MethodConfig | None = spec(None, help="quantization-aware training of weights")
    activation_quantization: MethodConfig | None = spec(None, help="fake-quantized inputs of linear layers")
    sparse_pruning: MethodConfig | None = spec(None, help="unstructured magnitude / top-k pruning")
    row_pruning: MethodConfig | None = spec(None, help="structured pruning of output rows (MLP neurons)")
    head_pruning: MethodConfig | None = spec(None, help="structured pruning of attention heads")
    channel_pruning: MethodConfig | None = spec(None, help="structured pruning of hidden channels")
    layer_reduction: LayerReductionConfig | None = spec(None, help="student initialized from teacher layers")

    def enabled_methods(self) -> list[MethodConfig]:
        """Grouped methods that are enabled, in the fixed order they are applied (masks before quantizers)."""
        out = []
        for name in GROUPED_METHODS:
            cfg = getattr(self, name)
            if cfg is not None and cfg.enabled:
                out.append(cfg)
        return out


def parse_compression_config(section: Mapping[str, Any] | CompressionConfig | None,
                             path: str = SECTION) -> CompressionConfig:
    """Parse the raw ``compression_training`` mapping; raises :class:`ConfigError` naming the full key path."""
    if isinstance(section, CompressionConfig):
        return section
    if section is None:
        return CompressionConfig()
    if not isinstance(section, Mapping):
        raise ConfigError(path, f"expected a JSON object, got {section!r} ({type(section).__name__})")
    accepted = [*GROUPED_METHODS, "layer_reduction"]
    kwargs: dict[str, Any] = {}
    for key, raw in section.items():
        key_path = f"{path}.{key}"
        if key == "layer_reduction":
            kwargs[key] = parse(LayerReductionConfig, raw, key_path)
            kwargs[key].validate(key_path)
        elif key in GROUPED_METHODS:
            kwargs[key] = _parse_method(key, raw, key_path)
        else:
            raise unknown_key(key, accepted, key_path, "unknown compression method")
    return CompressionConfig(**kwargs)


# the keys of one grouped method and of one of its groups (listed so in "accepted keys" errors)
_METHOD_KEYS = ["different_groups", "shared_parameters"]
_GROUP_KEYS = ["modules", "params", "related_modules"]


def _parse_method(method: str, raw: Any, path: str) -> MethodConfig:
    shared_cls, params_cls, needs_related = GROUPED_METHODS[method]
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected a JSON object, got {raw!r} ({type(raw).__name__})")
    check_keys(raw, _METHOD_KEYS, path)
    shared_path = f"{path}.shared_parameters"
    shared = parse(shared_cls, raw.get("shared_parameters"), shared_path)
    shared.validate(shared_path)
    groups_raw = raw.get("different_groups", {})
    groups_path = f"{path}.different_groups"
    if not isinstance(groups_raw, Mapping):
        raise ConfigError(groups_path, f"expected a JSON object of named groups, got {groups_raw!r}")
    if shared.enabled and not groups_raw:
        raise ConfigError(groups_path, f"{method} is enabled but has no groups; add one, e.g. "
                                       f'{{"g1": {{"params": {{...}}, "modules": ["*"]}}}}')
    groups = []
    for name, graw in groups_raw.items():
        gpath = f"{groups_path}.{name}"
        if not isinstance(graw, Mapping):
            raise ConfigError(gpath, f"expected a JSON object with params/modules, got {graw!r}")
        check_keys(graw, _GROUP_KEYS, gpath)
        params = parse(params_cls, graw.get("params"), f"{gpath}.params")
        params.validate(f"{gpath}.params", shared)
        modules = _string_list(graw.get("modules"), f"{gpath}.modules", required=True)
        related = _related(graw.get("related_modules"), f"{gpath}.related_modules")
        if needs_related and not related:
            raise ConfigError(f"{gpath}.related_modules",
                              f"{method} needs related_modules: the modules whose input side shrinks with the "
                              f"pruned ones (e.g. the down projection for an MLP up projection)")
        groups.append(Group(name=str(name), params=params, modules=modules, related_modules=related, path=gpath))
    return MethodConfig(method=method, shared=shared, groups=tuple(groups), path=path)


def _string_list(raw: Any, path: str, required: bool) -> tuple[str, ...]:
    if raw is None:
        if required:
            raise ConfigError(path, 'required: a list of module name patterns (regex), or ["*"] for all')
        return ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not all(isinstance(x, str) and x for x in raw):
        raise ConfigError(path, f"expected a list of non-empty strings, got {raw!r}")
    if required and not raw:
        raise ConfigError(path, 'must name at least one module pattern, or ["*"] for all')
    for i, pattern in enumerate(raw):
        if pattern == "*":
            continue
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"{path}[{i}]", f"invalid regular expression {pattern!r}: {err}") from None
    return tuple(raw)


def _related(raw: Any, path: str) -> tuple[str, ...]:
    """DeepSpeed writes related_modules as a list of lists (one per module pattern); both are accepted and
    flattened: every related pattern is looked up next to every matched module."""
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(path, f"expected a list of module name patterns, got {raw!r}")
    flat: list[str] = []
    for i, item in enumerate(raw):
        flat.extend(_string_list(item, f"{path}[{i}]", required=False))
    return tuple(flat)
