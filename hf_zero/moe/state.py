"""State dicts of expert-parallel MoE models under *global* expert indices.

With ``ep_size > 1`` a rank's module holds ``num_local`` experts named ``deepspeed_experts.0 .. num_local - 1``;
EP rank ``e``'s local expert ``l`` is global expert ``e * num_local + l`` (DeepSpeed's numbering). The checkpoint's
model file and ``save_16bit_model`` hold every expert under its global index -- the state dict of the same model
built with ``ep_size=1`` -- so it loads on any expert-parallel layout of the same ``num_experts``:

    global_state_dict(model, model.state_dict())   # collective over each EP group: every rank's experts
    local_state_dict(model, saved)                 # this rank's experts, renamed to their local indices
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hf_zero.comm import all_gather_packed
from hf_zero.moe.layer import MoE

__all__ = ["expert_parallel_layers", "global_state_dict", "local_state_dict"]


def expert_parallel_layers(module: nn.Module) -> list[tuple[str, MoE]]:
    """``(state-dict prefix of its experts, layer)`` of every MoE layer of ``module`` with ``ep_size > 1``."""
    out = []
    for name, m in module.named_modules():
        if isinstance(m, MoE) and m.ep_size > 1:
            out.append((f"{name}.deepspeed_moe.experts.deepspeed_experts." if name else
                        "deepspeed_moe.experts.deepspeed_experts.", m))
    return out


def _ep_rank(layer: MoE) -> int:
    group = layer.deepspeed_moe.ep_group
    if group is None:
        raise RuntimeError(f"MoE(ep_size={layer.ep_size}): no expert-parallel group yet (set at initialize)")
    return dist.get_rank(group)


def _split(key: str, prefix: str) -> tuple[int, str]:
    index, _, rest = key[len(prefix):].partition(".")
    return int(index), rest


def global_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (this rank's ``module.state_dict()``, or part of it) with every expert-parallel layer's local
    experts replaced by all ``num_experts`` experts under their global indices. Collective: every rank calls it."""
    out = dict(state)
    for prefix, layer in expert_parallel_layers(module):
        local = layer.num_local_experts
        keys = [k for k in state if k.startswith(prefix)]
        for k in keys:
            del out[k]
        suffixes = sorted({_split(k, prefix)[1] for k in keys})
        group = layer.deepspeed_moe.ep_group
        for suffix in suffixes:
            # (num_local, *shape) on every rank, gathered to (ep_size, num_local, *shape): global index e * L + l
            stacked = torch.stack([state[f"{prefix}{i}.{suffix}"].detach() for i in range(local)])
            rows = torch.empty(layer.ep_size, stacked.numel(), dtype=stacked.dtype, device=stacked.device)
            all_gather_packed(rows, stacked.reshape(-1), group=group,
                              what=f"the gather of every rank's experts {prefix}*.{suffix}")
            rows = rows.view(layer.ep_size * local, *stacked.shape[1:])
            for g in range(layer.ep_size * local):
                out[f"{prefix}{g}.{suffix}"] = rows[g]
    return out


def local_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`global_state_dict` for this rank: its experts' entries renamed to their local indices, the
    other experts' dropped. A state dict that is already local (no index past ``num_local``) passes unchanged."""
    out = dict(state)
    for prefix, layer in expert_parallel_layers(module):
        local = layer.num_local_experts
        keys = [k for k in state if k.startswith(prefix)]
        if not keys or max(_split(k, prefix)[0] for k in keys) < local:
            continue
        first = _ep_rank(layer) * local
        for k in keys:
            del out[k]
            index, rest = _split(k, prefix)
            if first <= index < first + local:
                out[f"{prefix}{index - first}.{rest}"] = state[k]
    return out
