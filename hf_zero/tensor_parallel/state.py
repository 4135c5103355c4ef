"""Between a TP-sharded model and ordinary (unsharded) weights: the format every checkpoint and export uses.

``full_state_dict(model)`` gathers each DTensor over the TP mesh and undoes the column permutation of fused
projections, so the result has the names, shapes and layout of the unsplit model (``from_pretrained`` loads it;
a run at another TP size re-shards it). ``load_full_state_dict(model, sd)`` is the inverse: each rank keeps its
slice of the full tensors. Both are collectives over the TP group when ``model`` is sharded (call on every rank).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hf_zero.tensor_parallel.apply import tp_info
from hf_zero.tensor_parallel.styles import fused_from_rank_major, fused_to_rank_major
from hf_zero.zero.gathered import GatheredParameters
from hf_zero.zero.stage3 import sharded_param_of

__all__ = ["full_state_dict", "load_full_state_dict", "full_tensor", "local_of"]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's data of ``t``: its local shard for a DTensor, ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(model: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """The unsharded value of ``model``'s tensor ``name`` (plain tensor, canonical column order)."""
    if not isinstance(t, DTensor):
        return t
    full = t.full_tensor()
    info = tp_info(model)
    if info is not None and _strip(name) in info.fused:
        parts, dim = info.fused[_strip(name)]
        full = fused_from_rank_major(full, parts, info.size, dim)
    return full


def _strip(name: str) -> str:
    # PEFT wraps the model (base_model.model.<name>) and its LoRA layers (<name>.base_layer.weight)
    name = name.replace(".base_layer.", ".")
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name


def full_state_dict(model: nn.Module, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered into its ordinary full tensor (see the module docstring).

    Under ZeRO-3 each rank's TP shards are themselves partitioned over the data-parallel group: they are gathered
    first (a collective over that group too) -- the TP shards held at once are fewer bytes than the result."""
    partitioned = [p for p in model.parameters() if sharded_param_of(p) is not None]
    if partitioned:
        with GatheredParameters(partitioned):
            full = _full_state_dict(model, keep_vars)
            if keep_vars:
                return full
            copies: dict[int, torch.Tensor] = {}  # by identity: tied names stay one tensor
            return {k: copies.setdefault(id(v), v.clone()) for k, v in full.items()}
    return _full_state_dict(model, keep_vars)


def _full_state_dict(model: nn.Module, keep_vars: bool) -> dict[str, torch.Tensor]:
    out, seen = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():  # keep_vars: tied weights keep one identity
        if id(t) in seen:  # a tied weight (GPT-2's LM head is the embedding): one tensor under both names
            out[name] = out[seen[id(t)]]
            continue
        seen[id(t)] = name
        out[name] = full_tensor(model, name, t if keep_vars else t.detach())
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> list[str]:
    """Copy full (unsharded) tensors into ``model``'s parameters and buffers, each rank keeping its slice.

    Returns the names in ``state`` the model has no tensor for (an error when ``strict``).
    """
    info = tp_info(model)
    own = model.state_dict(keep_vars=True)
    unexpected = [k for k in state if k not in own]
    missing = [k for k in own if k not in state]
    if strict and (unexpected or missing):
        raise KeyError(f"hf_zero: state dict does not match the model: missing {missing[:8]}, unexpected "
                       f"{unexpected[:8]}")
    for name, dst in own.items():
        if name not in state:
            continue
        src = state[name].to(dtype=dst.dtype)
        sp = sharded_param_of(dst)  # ZeRO-3: the rank's TP shard is partitioned over the data-parallel group
        if isinstance(dst, DTensor):
            if info is not None and _strip(name) in info.fused:
                parts, dim = info.fused[_strip(name)]
                src = fused_to_rank_major(src, parts, info.size, dim)
            # every rank holds the same full tensor: slice locally, no collective
            src = distribute_tensor(src.to(dst.to_local().device), dst.device_mesh, dst.placements,
                                    src_data_rank=None).to_local()
            if sp is not None:
                sp.store_full(src)
            else:
                dst.to_local().copy_(src)
        elif sp is not None:
            if tuple(src.shape) != tuple(sp.shape):
                raise ValueError(f"hf_zero: {name}: checkpoint shape {tuple(src.shape)} != model {tuple(sp.shape)}")
            sp.store_full(src)
        else:
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"hf_zero: {name}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
            dst.copy_(src)
    return unexpected
