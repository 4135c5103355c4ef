"""The tensor a rank actually holds for a parameter or gradient, whatever wraps it.

A tensor-parallel model's parameters are DTensors: the global view (shape, numel) spans every TP rank, while this
rank stores only its shard. ZeRO shards, reduces and publishes what this rank stores, so it goes through
:func:`local_tensor` wherever it reads sizes or storage. For a plain tensor that is the tensor itself.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local storage: for a DTensor the very tensor its operations read and write (rebinding its ``.data``
    rebinds the DTensor's), for anything else ``t``."""
    if isinstance(t, DTensor):
        with torch.no_grad():  # outside autograd, to_local() hands back the DTensor's own local tensor
            return t.to_local()
    return t
