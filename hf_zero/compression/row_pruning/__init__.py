"""Structured row pruning: ``config`` (schema), ``apply`` (install + clean plan)."""

from ..registry import Method, register
from .apply import install, plan_clean
from .config import RowPruningParams, RowPruningShared

METHOD = register(Method(name="row_pruning", install=install, plan_clean=plan_clean))

__all__ = ["RowPruningShared", "RowPruningParams", "install", "plan_clean", "METHOD"]
