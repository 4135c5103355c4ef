"""Copying state for ``torch.save``/safetensors: ``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``.

accelerate calls it on ``model.state_dict()`` before saving a ZeRO-1/2 model: a state dict's tensors are views
into parameters (and, for tied weights, into each other), so saving them directly would write whole storages
and shared tensors; cloning gives each entry its own compact storage on the target device.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """A copy of ``item`` with every tensor in it (nested in lists, tuples, dicts) detached and cloned onto
    ``device``; other values are returned as they are. A dict keeps its type (OrderedDict) and a state dict its
    ``_metadata`` (the per-module versions ``load_state_dict`` reads)."""
    if isinstance(device, str):
        device = torch.device(device)
    return _clone(item, device)


def _clone(item: Any, device: torch.device) -> Any:
    if torch.is_tensor(item):
        # .to() onto another device already copies; on the same device it would alias, so clone.
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [_clone(v, device) for v in item]
    if isinstance(item, tuple):
        values = [_clone(v, device) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)  # namedtuple or tuple
    if isinstance(item, dict):
        cloned = {k: _clone(v, device) for k, v in item.items()}
        try:
            out = type(item)(cloned)
        except TypeError:  # e.g. defaultdict, whose constructor takes a factory first
            out = cloned
        metadata = getattr(item, "_metadata", None)
        if metadata is not None and hasattr(out, "__dict__"):  # plain dicts take no attributes
            out._metadata = metadata
        return out
    return item
