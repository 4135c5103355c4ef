"""The tensor a rank actually holds for a parameter or gradient, whatever wraps it.

A tensor-parallel model's parameters are DTensors: the global view (shape, numel) spans every TP rank, while this
rank stores only its shard. ZeRO shards, reduces and publishes what this rank stores, so it goes through
:func:`local_tensor` wherever it reads sizes or storage. For a plain tensor that is the tensor itself.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor", "local_grad"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local storage: for a DTensor the very tensor its operations read and write (rebinding its ``.data``
    rebinds the DTensor's), for anything else ``t``."""
    if isinstance(t, DTensor):
        # the attribute, not to_local(): for an nn.Parameter DTensor to_local() returns an alias, and rebinding
        # the alias's .data (ZeRO's world-of-one views) would not reach the parameter
        return t._local_tensor
    return t


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p.grad``, laid out like ``local_tensor(p)``.

    A DTensor parameter's gradient can arrive in another layout than the parameter (a vocabulary-sharded
    embedding's gradient comes back replicated: every rank holds the full matrix); it is redistributed to the
    parameter's placements first. Callers go through parameters in one fixed order on every rank, as any
    redistribution that communicates requires.
    """
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return local_tensor(g)
