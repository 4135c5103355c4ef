"""True parameter counts and resident bytes under every ZeRO stage.

``p.numel()`` lies under ZeRO-3: a partitioned parameter's ``.data`` is a ``(0,)`` placeholder, so every counter
built on it (transformers' ``num_parameters``, the Trainer's ``total_flos``, DeepSpeed's ``model_to_params``)
reports the persistent parameters only. This module reads the sharded-parameter record instead, through the
attributes both DeepSpeed and hf_zero publish on a partitioned ``nn.Parameter`` (a duck-typed protocol, so
``profiling`` imports nothing from ``zero``)::

    ds_numel    int     elements of the whole parameter
    ds_tensor   Tensor  this rank's shard, (shard_numel,); empty while the shard is swapped to NVMe
    ds_persist  bool    the full parameter is also kept on every rank (small parameters)

Everything else is an ordinary tensor and counts with ``numel()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ParamCounts", "count_params", "true_numel", "resident_numel", "resident_nbytes"]


def true_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter, wherever its values are (ZeRO-3 record, else the tensor itself)."""
    numel = getattr(param, "ds_numel", None)
    return int(numel) if numel is not None else param.numel()


def resident_numel(param: torch.Tensor) -> int:
    """Elements of this parameter held on this rank at rest (see :func:`resident_nbytes`)."""
    shard = getattr(param, "ds_tensor", None)
    if shard is None:
        return param.numel()
    return shard.numel() + (param.numel() if getattr(param, "ds_persist", False) else 0)


def resident_nbytes(param: torch.Tensor) -> int:
    """Bytes of this parameter held on this rank at rest: the shard, plus the full copy of a persistent one.

    A gathered (in-use) full copy of a non-persistent parameter is transient and not counted.
    """
    shard = getattr(param, "ds_tensor", None)
    if shard is None:
        return param.numel() * param.element_size()
    nbytes = shard.numel() * shard.element_size()
    if getattr(param, "ds_persist", False):
        nbytes += param.numel() * param.element_size()
    return nbytes


@dataclass(frozen=True)
class ParamCounts:
    """Parameter totals of one model, each parameter counted once (tied weights are one parameter)."""

    total: int
    trainable: int
    embedding: int          # weights of nn.Embedding modules (what transformers' exclude_embeddings drops)
    resident_numel: int     # elements of parameters this rank holds at rest (shards + persistent copies)
    resident_bytes: int     # their bytes
    sharded: bool           # some parameter is partitioned (ZeRO-3)

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_params(model: nn.Module) -> ParamCounts:
    """Count ``model``'s parameters from their true sizes (see the module docstring)."""
    embedding_ids = {id(m.weight) for m in model.modules()
                     if isinstance(m, nn.Embedding) and isinstance(getattr(m, "weight", None), torch.Tensor)}
    total = trainable = embedding = resident = resident_elems = 0
    sharded = False
    for p in model.parameters():  # deduplicated by nn.Module
        numel = true_numel(p)
        total += numel
        if p.requires_grad:
            trainable += numel
        if id(p) in embedding_ids:
            embedding += numel
        resident += resident_nbytes(p)
        resident_elems += resident_numel(p)
        sharded = sharded or hasattr(p, "ds_tensor")
    return ParamCounts(total=total, trainable=trainable, embedding=embedding, resident_numel=resident_elems, resident_bytes=resident,
                       sharded=sharded)
