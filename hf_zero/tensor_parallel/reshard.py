"""Per-parameter TP layouts, and re-cutting a flat per-rank piece (master weight, Adam moment) for another TP size.

A checkpoint written at TP size ``t`` holds, per TP rank, the flat local piece of every parameter's state.
:func:`param_layout` records how each parameter was split (full shape, sharded dim, fused q|k|v parts);
:func:`full_from_pieces` rebuilds the unsplit tensor in the model's canonical order from the ``t`` saved pieces and
:func:`piece_for` cuts this rank's piece for the current layout. The saved and current layouts may differ in
more than the size: a parameter replicated at save time (no TP at all) is cut by the current plan, and the other
way round. Used by the TP engine's and the 3D pipeline's checkpoints (hf_zero/checkpoint/tp.py,
pipeline.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hf_zero.tensor_parallel.apply import tp_info
from hf_zero.tensor_parallel.styles import fused_from_rank_major, fused_to_rank_major
from hf_zero.zero.stage3 import sharded_param_of

__all__ = ["param_layout", "replicated_layout", "split_sizes", "full_from_pieces", "piece_for"]


def param_layout(module: nn.Module) -> dict[str, dict]:
    """``{name: {"shape", "dim", "fused"}}`` for every parameter (a tied weight under each of its names): the full
    shape, the sharded dim (None: replicated, or no tensor parallelism) and the fused ``(parts, dim)``."""
    info = tp_info(module)
    fused = info.fused if info is not None else {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        shard = next((pl for pl in p.placements if isinstance(pl, Shard)), None) if isinstance(p, DTensor) else None
        sp = sharded_param_of(p)  # ZeRO-3 partitioned: a plain tensor's shape is its placeholder's until gathered
        shape = p.shape if isinstance(p, DTensor) or sp is None else sp.shape
        out[name] = {"shape": list(shape), "dim": None if shard is None else shard.dim % p.dim(),
                     "fused": list(fused[name]) if name in fused else None}
    return out


def replicated_layout(shape) -> dict:
    """The layout of a parameter saved without tensor parallelism."""
    return {"shape": list(shape), "dim": None, "fused": None}


def split_sizes(n: int, parts: int) -> list[int]:
    """torch.chunk's split of ``n`` elements in ``parts`` (DTensor's Shard layout): trailing parts may be empty."""
    chunk = -(-n // parts)
    return [max(0, min(chunk, n - r * chunk)) for r in range(parts)]


def full_from_pieces(layout: dict, pieces: list[torch.Tensor], saved_tp: int) -> torch.Tensor:
    """The unsplit tensor (shape ``layout["shape"]``, canonical column order) from the saved TP ranks' flat
    pieces. A replicated parameter is whole in every piece: the first is used."""
    shape = tuple(layout["shape"])
    dim = layout["dim"]
    if dim is None:
        return pieces[0].view(shape)
    parts = [pieces[r].view(shape[:dim] + (size,) + shape[dim + 1:])
             for r, size in enumerate(split_sizes(shape[dim], saved_tp))]
    full = torch.cat(parts, dim=dim)
    if layout["fused"] is not None:
        n, fdim = layout["fused"]
        full = fused_from_rank_major(full, n, saved_tp, fdim)
    return full


def piece_for(full: torch.Tensor, layout: dict, tp: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s flat piece of ``full`` under ``layout`` at TP size ``tp``."""
    dim = layout["dim"]
    if dim is None:
        return full.reshape(-1)
    if layout["fused"] is not None:
        n, fdim = layout["fused"]
        full = fused_to_rank_major(full, n, tp, fdim)
    return torch.split(full, split_sizes(full.shape[dim], tp), dim=dim)[tp_rank].reshape(-1)
