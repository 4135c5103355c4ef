"""``engine.offload_states()`` / ``engine.reload_states()``: move training state off the accelerator between uses
(e.g. while another model generates in RLHF) and back, as DeepSpeed's methods of the same names.

    engine.offload_states(include=[OffloadStateTypeEnum.optim_states], device=OffloadDeviceEnum.cpu)
    ...                                  # accelerator memory of those states is free here
    engine.reload_states()               # before the next forward / step

State types (DeepSpeed's ``OffloadStateTypeEnum``) and what they are here, per optimizer group
(:class:`~hf_zero.zero.sharded_group.ShardedGroup`):

    hp_params               the fp32 master shard (``master``)
    optim_states            every tensor of the optimizer's state for that shard (Adam's moments, step)
    lp_params               the 16-bit shard (``param16``) and the model's own copies of the weights: the full
                            parameters at stages 0-2, the persistent full parameters at stage 3
    lp_grads                the gradient shard (``grad``)
    contiguous_grad_buffer  hf_zero keeps no persistent reduction buffer (buckets live only during backward):
                            nothing to move

A tensor is moved by replacing its storage (``tensor.data``), so every holder of the tensor object (optimizer
param groups and state, schedulers) stays valid; the views into moved storage -- ZeRO-3 shards and gradient slots,
a world of one's parameters -- are re-pointed after each move, and the old storage is released. A tensor already
on the target device does not move: on a CPU-only machine every state already lives in host memory, so
``offload_states(device=cpu)`` moves nothing (as DeepSpeed's does there) and only records what is "offloaded".
"""

from __future__ import annotations

import enum
from typing import Iterable

import torch

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "StateOffloader"]


class OffloadDeviceEnum(str, enum.Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.offload_config.OffloadDeviceEnum``."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum``."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class StateOffloader:
    """Owns what one engine has offloaded: ``{state type: [(tensor, device it came from)]}``."""

    def __init__(self, groups, optimizer, module: torch.nn.Module):
        self.groups = groups
        self.optimizer = optimizer
        self.module = module
        self.offloaded: dict[OffloadStateTypeEnum, list[tuple[torch.Tensor, torch.device]]] = {}
        self.moved_bytes = 0  # of the last offload_states / reload_states call
        self._always_copy = False  # tests: move storage even when already on the target (the path a GPU run takes)

    # ---- which tensors --------------------------------------------------------------------------------------------
    def _tensors(self, kind: OffloadStateTypeEnum) -> list[torch.Tensor]:
        from hf_zero.zero.stage3.param import sharded_param_of

        out: list[torch.Tensor] = []
        for g in self.groups:
            if kind is OffloadStateTypeEnum.hp_params:
                out.append(g.master)
            elif kind is OffloadStateTypeEnum.optim_states:
                out.extend(v for v in self.optimizer.state.get(g.master, {}).values() if torch.is_tensor(v))
            elif kind is OffloadStateTypeEnum.lp_grads:
                out.append(g.grad)
            elif kind is OffloadStateTypeEnum.lp_params:
                if g.param16 is not None and g.param16 is not g.master:
                    out.append(g.param16)
                for p in g.params:
                    sp = sharded_param_of(p)
                    bound = g.world_size == 1 and sp is None  # a view of param16: re-pointed, not moved
                    if (sp is None and not bound) or (sp is not None and sp.persistent):
                        out.append(p)
        if kind is OffloadStateTypeEnum.lp_params:  # frozen parameters are weights the model computes with too
            trained = {id(p) for g in self.groups for p in g.params}
            out.extend(p for p in self.module.parameters() if id(p) not in trained and p.numel() > 0)
        seen, unique = set(), []
        for t in out:
            if id(t) not in seen:
                seen.add(id(t))
                unique.append(t)
        return unique

    # ---- moves ----------------------------------------------------------------------------------------------------
    def _relocate(self, t: torch.Tensor, device: torch.device, pin_memory: bool, non_blocking: bool) -> int:
        if t.device == device and not self._always_copy:
            return 0
        pin = pin_memory and device.type == "cpu" and t.device.type == "cuda"
        new = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
        new.copy_(t.data, non_blocking=non_blocking)
        t.data = new
        return t.numel() * t.element_size()

    def _repoint_views(self) -> None:
        """Views into moved storage follow it: ZeRO-3 shards and gradient slots, a world of one's parameters."""
        from hf_zero.zero.stage3.param import sharded_param_of

        for g in self.groups:
            sps = getattr(g, "sps", None)
            if sps is not None:
                for i, sp in enumerate(sps):
                    lo, hi = g.layout.offsets[i], g.layout.offsets[i + 1]
                    if g.param16 is not None:
                        sp.use_shard_storage(g.param16[lo:hi], copy=False)  # the values moved with the buffer
                    if sp.grad_storage is not None:
                        sp.use_grad_storage(g.grad[lo:hi])
            elif g.world_size == 1 and g.param16 is not None and all(sharded_param_of(p) is None for p in g.params):
                g._bind_params()

    def offload(self, include: Iterable | None, device, pin_memory: bool, non_blocking: bool) -> None:
        target = _target(device)
        kinds = _kinds(include)
        self.moved_bytes = 0
        for kind in kinds:
            if kind in self.offloaded:
                continue  # already offloaded: DeepSpeed skips it too
            moved = []
            for t in self._tensors(kind):
                origin = t.device
                self.moved_bytes += self._relocate(t, target, pin_memory, non_blocking)
                moved.append((t, origin))
            self.offloaded[kind] = moved
        self._repoint_views()
        if target.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the freed accelerator blocks back

    def reload(self, non_blocking: bool) -> None:
        self.moved_bytes = 0
        for kind, moved in list(self.offloaded.items()):
            for t, origin in moved:
                self.moved_bytes += self._relocate(t, origin, False, non_blocking)
            del self.offloaded[kind]
        self._repoint_views()


def _kinds(include: Iterable | None) -> list[OffloadStateTypeEnum]:
    if include is None:
        return list(OffloadStateTypeEnum)
    kinds = []
    for item in include:
        try:
            kinds.append(OffloadStateTypeEnum(item.value if isinstance(item, enum.Enum) else item))
        except ValueError:
            raise ValueError(f"offload_states(include=...): unknown state type {item!r}; use "
                             f"{', '.join(k.value for k in OffloadStateTypeEnum)}") from None
    return kinds


def _target(device) -> torch.device:
    value = device.value if isinstance(device, enum.Enum) else str(device)
    if value != OffloadDeviceEnum.cpu.value:
        raise ValueError(f"offload_states(device={value!r}): only OffloadDeviceEnum.cpu is supported (as in "
                         "DeepSpeed)")
    return torch.device("cpu")
