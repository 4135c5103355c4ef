"""Tiled compute along the sequence (ALST's other memory saver, DeepSpeed's names and call signatures): a per-token
function runs on one tile of the tokens at a time, and only one tile's intermediates are alive at once.

    loss = TiledFusedLogitsLoss.apply(loss_fn, lm_head_owner, hidden_states, shift_labels, None, shards,
                                      compute_params, "mean")   # never more than tokens/shards rows of logits
    h = TiledMLP.apply(mlp_forward, mlp, x, shards, compute_params)

Each tile runs under non-reentrant activation checkpointing: its forward keeps only its output, and backward
recomputes the tile's intermediates (logits, the MLP's 4x-wide hidden) one tile at a time. All tiles stay in the one
autograd graph of the step, so every parameter's gradient is accumulated once per backward, as without tiling --
which is what hf_zero's gradient hooks (and torch's DDP / FSDP) expect. DeepSpeed instead runs each tile's backward
inside the forward and needs ``compute_params`` to hold back its ZeRO hooks until the last tile; hf_zero accepts
``compute_params`` for compatibility and has no use for it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["sequence_tiled_compute", "TiledFusedLogitsLoss", "TiledMLP"]

REDUCTIONS = (None, "mean", "sum")


def _reduce(out: torch.Tensor, reduction: str | None) -> torch.Tensor:
    if reduction not in REDUCTIONS:
        raise ValueError(f"output_reduction={reduction!r}: one of {REDUCTIONS}")
    return out if reduction is None else (out.mean() if reduction == "mean" else out.sum())


def sequence_tiled_compute(fn: Callable[..., torch.Tensor], seqlen: int, shards: int,
                           kwargs_to_shard: Mapping[str, torch.Tensor], kwargs_to_pass: Mapping[str, Any],
                           grad_requiring_tensor_key: str, compute_params=None, output_unshard_dimension: int = 1,
                           output_reduction: str | None = "mean") -> torch.Tensor:
    """``fn(**tile_of(kwargs_to_shard), **kwargs_to_pass)`` on ``shards`` tiles of the sequence (dim 1 of every
    ``kwargs_to_shard`` tensor, ``ceil(seqlen / shards)`` tokens each), outputs concatenated along
    ``output_unshard_dimension`` (0: per-tile scalars stacked), then ``output_reduction`` (None, "mean", "sum").
    ``grad_requiring_tensor_key`` names the input gradients flow to (checked to be one of the inputs)."""
    if grad_requiring_tensor_key not in kwargs_to_shard and grad_requiring_tensor_key not in kwargs_to_pass:
        raise ValueError(f"grad_requiring_tensor_key={grad_requiring_tensor_key!r} is not one of the inputs "
                         f"{sorted([*kwargs_to_shard, *kwargs_to_pass])}")
    step = math.ceil(seqlen / shards)
    keys = list(kwargs_to_shard)

    def tile_fn(*tiles):
        return fn(**dict(zip(keys, tiles)), **kwargs_to_pass)

    outs = []
    for start in range(0, seqlen, step):
        tiles = [kwargs_to_shard[k][:, start:start + step] for k in keys]
        outs.append(checkpoint(tile_fn, *tiles, use_reentrant=False))
    if output_unshard_dimension == 0:
        out = torch.stack([o.reshape(()) if o.dim() == 0 else o for o in outs], dim=0)
    else:
        out = torch.cat(outs, dim=output_unshard_dimension)
    return _reduce(out, output_reduction)


class TiledFusedLogitsLoss:
    """``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)``: ``fn(self,
    x_tile, y_tile[, mask_tile])`` returns a tile's loss; the result is the "mean" (of the per-tile losses, as
    DeepSpeed) or "sum" of them. Tiles are cut over the flattened ``[batch * seq]`` rows. With unequal tiles or a
    mask, use "sum" of per-tile sums and divide by the count yourself, as DeepSpeed advises.

    A plain class with DeepSpeed's ``apply`` (not an ``autograd.Function``): the tiles' gradients flow through the
    ordinary graph (module docstring)."""

    @staticmethod
    def apply(fn, self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, shards: int,
              compute_params=None, output_reduction: str = "mean") -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'output_reduction={output_reduction!r}: "mean" or "sum"')
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be [batch, seq, ...]")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"mask {tuple(mask.shape)} must be [batch, seq] = {tuple(x.shape[:2])}")
        rows = [x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])]
        if mask is not None:
            rows.append(mask.reshape(-1))
        losses = [checkpoint(fn, self, *tile, use_reentrant=False)
                  for tile in zip(*(r.chunk(shards, dim=0) for r in rows))]
        return _reduce(torch.stack([loss.reshape(()) for loss in losses]), output_reduction)


class TiledMLP:
    """``TiledMLP.apply(fn, self, x, shards, compute_params)``: ``fn(self, x_tile)`` on ``shards`` tiles of the
    flattened ``[batch * seq, hidden]`` rows, reassembled to ``x``'s shape."""

    @staticmethod
    def apply(fn, self, x: torch.Tensor, shards: int, compute_params=None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        outs = [checkpoint(fn, self, tile, use_reentrant=False) for tile in rows.chunk(shards, dim=0)]
        out = torch.cat(outs, dim=0)
        return out.reshape(*x.shape[:-1], out.shape[-1])
