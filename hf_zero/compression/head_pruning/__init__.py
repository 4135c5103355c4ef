"""Attention-head pruning: ``config`` (schema), ``apply`` (install + clean plan)."""

from ..registry import Method, register
from .apply import install, plan_clean
from .config import HeadPruningParams, HeadPruningShared

METHOD = register(Method(name="head_pruning", install=install, plan_clean=plan_clean))

__all__ = ["HeadPruningShared", "HeadPruningParams", "install", "plan_clean", "METHOD"]
