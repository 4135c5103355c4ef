"""The full state dict of a partitioned module on rank 0, streamed module by module.

Every rank walks the module tree in ``state_dict`` order; for each module it gathers that module's own
partitioned parameters (one collective), rank 0 copies them out (cast to ``dtype``), and every rank frees them
before the next module. Rank 0's peak is therefore one module's parameters plus the output being built; the
other ranks never hold more than one module's parameters.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from hf_zero.comm import get_rank

from .gather import gatherer_for
from .param import ParamState, sharded_param_of

__all__ = ["consolidated_state_dict"]


def consolidated_state_dict(module: nn.Module, *, dtype: torch.dtype | None = None,
                            exclude_frozen: bool = False, group=None,
                            full_of: Callable[[str, torch.Tensor], torch.Tensor] | None = None
                            ) -> dict[str, torch.Tensor] | None:
    """Call on every rank. Returns ``{name: full tensor}`` (CPU) on rank 0 of ``group``, None on the others.

    Tied parameters appear under every name they have, as one tensor (like ``module.state_dict()``).
    Persistent buffers are included; ``exclude_frozen`` drops parameters with ``requires_grad=False``.
    ``full_of(name, tensor)``: the unsplit value of a gathered parameter or buffer as the module holds it (a
    tensor-parallel DTensor's shards joined: a collective over its TP group, so every rank calls it, in the same
    order); without it the gathered tensor is the value.
    """
    rank = get_rank(group)
    out: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    done: dict[int, torch.Tensor | None] = {}  # ds_id or id(param) -> rank 0's output tensor
    gatherer = None
    for prefix, mod in module.named_modules(remove_duplicate=False):
        prefix = prefix + "." if prefix else ""
        entries = [(prefix + n, p) for n, p in mod._parameters.items()
                   if p is not None and not (exclude_frozen and not p.requires_grad)]
        todo = []
        for _, p in entries:
            sp = sharded_param_of(p)
            if sp is not None and sp.ds_id not in done and sp.state is not ParamState.AVAILABLE and sp not in todo:
                todo.append(sp)
        if todo:
            gatherer = gatherer or gatherer_for(todo[0].group)
            for sp in todo:
                gatherer.wait_available(sp)  # a prefetch may be in flight
            need = [sp for sp in todo if sp.state is ParamState.PARTITIONED]
            if need:
                gatherer.gather(need, f"state dict of module {prefix[:-1] or '<root>'!r}", header_check=True)
        else:
            need = []
        for name, p in entries:
            sp = sharded_param_of(p)
            key = sp.ds_id if sp is not None else id(p)
            if key not in done:
                value = full_of(name, p.detach()) if full_of is not None else p.data if sp is None else sp.data
                done[key] = _copy_out(value, dtype) if out is not None else None
            if out is not None:
                out[name] = done[key]
        for sp in need:
            gatherer.release(sp)
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                value = full_of(prefix + n, b) if full_of is not None else b
                if out is not None:
                    out[prefix + n] = _copy_out(value, dtype if b.is_floating_point() else None)
    if gatherer is not None:
        gatherer.check_deferred()  # (GPU) every rank gathered the same parameters: the state dict is whole
    return out


def _copy_out(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        return t.to(device="cpu", dtype=dtype, copy=True)
    return t.to(device="cpu", copy=True)
