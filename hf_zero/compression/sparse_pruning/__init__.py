"""Unstructured pruning: ``config`` (schema), ``apply`` (install); the mask itself is
:class:`hf_zero.compression.masking.UnitMask` with one unit per weight. Cleaning folds the zeros into the weight
(the tensor keeps its shape: unstructured sparsity makes a model smaller only once stored sparse)."""

from ..registry import Method, register
from .apply import install
from .config import SparsePruningParams, SparsePruningShared

METHOD = register(Method(name="sparse_pruning", install=install))

__all__ = ["SparsePruningShared", "SparsePruningParams", "install", "METHOD"]
