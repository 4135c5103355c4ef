"""Putting the user's module on the device the engine trains on (DeepSpeed's ``module.to(device)`` at initialize).

The engine calls :func:`place_module` before it builds anything from the parameters, so every buffer it derives
from them -- flat shards, masters, gradients, optimizer states -- is allocated where the parameters are, on the
device (see hf_zero/comm/device.py for which one).

* A plain parameter is moved by rebinding ``param.data``: the Parameter object stays the same, so an optimizer or
  a ``model_parameters`` list built before ``initialize`` still names the parameters the engine trains.
* A parameter zero.Init already partitioned keeps its (empty) placeholder; its shard moves to the device.
* ``params_on_host`` (ZeRO-3 with ``offload_param``): no parameter moves. Shards stay in host memory or swap files,
  and a parameter not yet partitioned stays on the host so that its shards are cut there (the full model never
  visits the GPU); the ZeRO-3 gathers bring each module's parameters to the device when it runs.
* Buffers (rotary tables, masks, running statistics) move too: the forward reads them beside the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_zero.zero.local import local_tensor
from hf_zero.zero.stage3.param import sharded_param_of

__all__ = ["place_module"]


def place_module(module: nn.Module, device: torch.device, *, params_on_host: bool = False) -> int:
    """Move ``module``'s parameters, ZeRO-3 shards and buffers to ``device``; returns how many tensors moved."""
    device = torch.device(device)
    moved = 0
    seen: set[int] = set()
    with torch.no_grad():
        for mod in module.modules():
            for p in () if params_on_host else mod._parameters.values():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))  # tied weights: one Parameter registered on two modules moves once
                sp = sharded_param_of(p)
                if sp is not None:
                    moved += sp.to_device(device)
                    continue
                local = local_tensor(p)  # a tensor-parallel DTensor moves its own shard
                if local.device != device:
                    local.data = local.data.to(device)
                    moved += 1
            for name, b in mod._buffers.items():
                if b is not None and b.device != device:
                    mod._buffers[name] = b.to(device)
                    moved += 1
    return moved
