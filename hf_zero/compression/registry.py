"""Compression methods by name. Each method folder registers one :class:`Method` in its ``__init__``.

``install`` swaps :class:`~hf_zero.compression.layer.CompressedLinear` into the model and attaches the method's
transforms; ``plan_clean`` (structured methods only) reads the final masks and returns the slices that
:func:`~hf_zero.compression.redundancy_clean` applies once every weight has been folded.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn

__all__ = ["Method", "Slice", "CleanPlan", "register", "get_method", "METHODS"]


@dataclasses.dataclass(frozen=True)
class Slice:
    """Keep only ``index`` along ``dim`` (0: output rows and bias, 1: input columns) of linear ``module``."""

    module: str
    dim: int
    index: Any  # 1-D LongTensor, ascending


@dataclasses.dataclass
class CleanPlan:
    slices: list[Slice] = dataclasses.field(default_factory=list)
    # attribute updates after slicing: (object path relative to the model, or "config", attribute, value)
    updates: list[tuple[str, str, Any]] = dataclasses.field(default_factory=list)
    # extra actions after slicing, e.g. slicing embeddings or norms (channel pruning)
    extra: list[Callable[[nn.Module], None]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    install: Callable[..., list[str]]  # (model, method_config) -> names of modules changed
    plan_clean: Callable[..., CleanPlan] | None = None  # (model, method_config) -> CleanPlan


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"compression method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    if not METHODS:
        _load_builtin()
    if name not in METHODS:
        raise KeyError(f"no compression method {name!r}; registered: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def _load_builtin() -> None:
    """Import every grouped method's folder, which registers it. Imported here, not at the top: the folders
    import this module."""
    import importlib

    from .config import GROUPED_METHODS

    for name in GROUPED_METHODS:
        importlib.import_module(f"hf_zero.compression.{name}")
