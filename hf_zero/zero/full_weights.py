"""Writing new weights into a model an hf_zero engine trains, every copy of them at once.

An engine keeps up to three copies of a trained parameter (the table in ``sharded_group.py``): the optimizer's
fp32 master shard, the 16-bit shard the published weights come from, and the module's full tensor (stages 0-2, or
a ZeRO-3 parameter while gathered or persistent). The next ``engine.step`` updates the master and publishes it, so
a write that reaches only the module's tensor (``module.load_state_dict``) is undone by that step. The functions
here keep the copies together:

- :func:`set_full_weights` -- ``(param, full value)`` pairs: each copy gets the value, the fp32 master at the
  value's own precision. Frozen parameters (no master) get their 16-bit shard and full tensor.
- :func:`adopt_module_weights` -- after code wrote the model's weights itself (a ``custom_load_fn``, a
  ``GatheredParameters`` block with a modifier rank): each master element whose 16-bit weight no longer equals it
  (cast to 16 bit) takes the 16-bit value; the elements that still agree keep their fp32 precision.
- :func:`state_dict_names` -- the keys ``module.load_state_dict`` expects, read without gathering anything.

None of them communicates: each rank cuts its own shard out of the full value, so every rank must pass the same
values (a checkpoint loaded on every rank, as DeepSpeed's are). Under ``offload_optimizer`` the masters are read
and written back whole per optimizer group, in memory or through the offload's NVMe files.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from hf_zero.zero.stage3.gather import gatherer_for
from hf_zero.zero.stage3.param import ParamState, sharded_param_of
from hf_zero.zero.tensor_fragment import fragment_of

__all__ = ["set_full_weights", "adopt_module_weights", "state_dict_names", "full_shape"]


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's shape as the model sees it (a ZeRO-3 parameter's ``.data`` is a (0,) placeholder)."""
    sp = sharded_param_of(param)
    return torch.Size(sp.shape) if sp is not None else param.shape


def set_full_weights(items: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``param <- value`` for each pair, in every copy hf_zero keeps (see the module docstring). ``value`` has the
    parameter's number of elements, any float dtype, any device."""
    from hf_zero.offload.swapper import wait_all

    offloaded: dict[tuple[int, int], list] = {}  # (id(optimizer), group index) -> [(fragment, shard, param, value)]
    with torch.no_grad():
        for param, value in items:
            value = value.detach()
            numel = full_shape(param).numel()
            if value.numel() != numel:
                raise ValueError(f"hf_zero: a value of shape {tuple(value.shape)} for a parameter of shape "
                                 f"{tuple(full_shape(param))}")
            _wait_gathered(param)
            frag = fragment_of(param)
            if frag is None:
                _write_untrained(param, value)
                continue
            shard = _own_shard(frag, value.reshape(-1).float())
            if frag.group.master.is_meta:  # offload_optimizer: the back-end holds the master
                offloaded.setdefault((id(frag.optimizer), frag.group_index), []).append((frag, shard, param, value))
                continue
            lo, hi = frag.span
            frag.group.master[lo:hi].copy_(shard)
            wait_all(frag.group.write_param16(lo, hi, frag.group.master[lo:hi]))
            _write_full_copy(param, frag, value)
        for entries in offloaded.values():
            frag0 = entries[0][0]
            offload, gi = frag0.optimizer.offload, frag0.group_index
            master = offload.state_tensors(gi)["master"]
            for frag, shard, _, _ in entries:
                lo, hi = frag.span
                master[lo:hi].copy_(shard)
            offload.load_state_tensors(gi, {"master": master})  # also rewrites the group's 16-bit shard
            for frag, _, param, value in entries:
                _write_full_copy(param, frag, value)


def adopt_module_weights(params: Iterable[torch.Tensor]) -> None:
    """For each trained parameter of ``params``: master elements whose 16-bit weight was changed behind the
    optimizer's back take the 16-bit value (see the module docstring). The 16-bit values are read from the
    module's full tensor where this rank holds one, else from the ZeRO-3 shard."""
    from hf_zero.offload.swapper import wait_all

    offloaded: dict[tuple[int, int], list] = {}
    with torch.no_grad():
        for param in params:
            frag = fragment_of(param)
            if frag is None:
                continue
            _wait_gathered(param)
            sp = sharded_param_of(param)
            if sp is not None and sp.state is not ParamState.AVAILABLE:
                src = sp.shard_values().float()  # (shard_numel,), zero-padded like the master
                dtype = sp.dtype
            else:
                src = _own_shard(frag, param.data.reshape(-1).float())
                dtype = param.dtype
            if frag.group.master.is_meta:
                offloaded.setdefault((id(frag.optimizer), frag.group_index), []).append((frag, src, dtype))
                continue
            lo, hi = frag.span
            master = frag.group.master[lo:hi]
            master.copy_(_adopted(master, src, dtype))
            wait_all(frag.group.write_param16(lo, hi, master))
        for entries in offloaded.values():
            offload, gi = entries[0][0].optimizer.offload, entries[0][0].group_index
            master = offload.state_tensors(gi)["master"]
            for frag, src, dtype in entries:
                lo, hi = frag.span
                master[lo:hi].copy_(_adopted(master[lo:hi], src.to(master.device), dtype))
            offload.load_state_tensors(gi, {"master": master})


def state_dict_names(module: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """``(parameter keys, persistent buffer keys, extra-state keys)`` of ``module.state_dict()``, in its order and
    with tied parameters under each of their names, as ``load_state_dict`` expects them."""
    params, buffers, extra = [], [], []
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        params += [dot + n for n, p in mod._parameters.items() if p is not None]
        buffers += [dot + n for n, b in mod._buffers.items()
                    if b is not None and n not in mod._non_persistent_buffers_set]
        if type(mod).get_extra_state is not nn.Module.get_extra_state:
            extra.append(dot + "_extra_state")
    return params, buffers, extra


def _adopted(master: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``master`` where its ``dtype`` cast equals ``src`` (the 16-bit values, as fp32), else ``src``."""
    changed = src != master.to(dtype).float()
    return torch.where(changed, src.to(master.dtype), master)


def _own_shard(frag, flat: torch.Tensor) -> torch.Tensor:
    """This rank's (shard_numel,) fp32 shard of the full flat fp32 ``flat``, zero-padded, on the master's device
    (the CPU when the master is offloaded)."""
    group = frag.group
    device = group.master.device if not group.master.is_meta else torch.device("cpu")
    out = torch.empty(frag.span[1] - frag.span[0], dtype=torch.float32, device=device)
    group.layout.shard_of(flat.to(device), frag.index, group.rank, out)
    return out


def _wait_gathered(param: torch.Tensor) -> None:
    """A ZeRO-3 gather still in flight would overwrite the full tensor after the write: let it land first."""
    sp = sharded_param_of(param)
    if sp is not None:
        gatherer_for(sp.group).wait_available(sp)


def _write_full_copy(param: torch.Tensor, frag, value: torch.Tensor) -> None:
    """The module's full tensor where this rank holds one apart from the 16-bit shard: stages 1-2 (stage 0's
    parameters are views of the shard the master write refreshed), or a gathered/persistent ZeRO-3 parameter."""
    sp = sharded_param_of(param)
    holds_full = (sp is None and frag.group.world_size > 1) or (sp is not None and sp.state is ParamState.AVAILABLE)
    if holds_full:
        param.data.copy_(value.reshape(param.shape))


def _write_untrained(param: torch.Tensor, value: torch.Tensor) -> None:
    """A parameter no optimizer owns (frozen, an evaluation engine): its ZeRO-3 shard and any full copy, or the
    plain tensor."""
    sp = sharded_param_of(param)
    if sp is None:
        param.data.copy_(value.reshape(param.shape))
        return
    shard = torch.empty(sp.shard_numel, dtype=sp.dtype, device=sp.storage.device)
    sp.layout.shard_of(value.reshape(-1).to(device=shard.device, dtype=sp.dtype), 0, sp.rank, shard)
    sp.store_shard(shard)
    if sp.state is ParamState.AVAILABLE:
        param.data.copy_(value.reshape(param.shape))
