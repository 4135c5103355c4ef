"""DeepSpeed's ``safe_get_*`` / ``safe_set_*``: a parameter's fp32 master, gradient and optimizer state as full
tensors (assembled from every rank's shard) or as this rank's shard, at every ZeRO stage.

    loss = engine(batch); engine.backward(loss)
    grad = safe_get_full_grad(model.fc.weight)                       # fp32, model.fc.weight's shape, every rank
    m = safe_get_full_optimizer_state(model.fc.weight, "exp_avg")   # after the first step
    engine.step()

Where the values live (:class:`~hf_zero.zero.sharded_group.ShardedGroup`, the same layout at every stage): the shard
of parameter ``index`` inside the group's flat ``master`` / ``grad`` / optimizer-state shards, ``shard_numel``
elements per rank, rank r holding elements ``[r * shard_numel, (r + 1) * shard_numel)`` of the flattened parameter
(zero-padded past its end). Stage 0 is a world of one whose ``grad`` is already averaged over every rank.

- The *full* functions are collectives over the engine's data-parallel group when it shards (stages 1-3): call
  them on every rank, in the same order. ``safe_set_full_*`` take the full value, the same on every rank.
- The gradient is the reduced (averaged) gradient once the reduction ran -- after ``engine.backward`` at stages
  2/3 and at the accumulation boundary at stages 0/1 -- until ``engine.step`` clears it; before the reduction
  (stages 0/1 between boundaries) it is this rank's ``param.grad``, as in DeepSpeed; None when there is neither.
  With fp16 loss scaling it is still multiplied by the loss scale, as DeepSpeed's.
- *Local* functions return this rank's shard, 1-D and padded (DeepSpeed defines them for ZeRO-3 shards). The
  local setters are refused at stages 0-2, where every rank holds the full weights: writing one shard would leave
  the ranks disagreeing; use the full setter there.
- A parameter the optimizer does not own (frozen, or no engine) gives None from the getters, as in DeepSpeed.
- ``safe_update_full_grad_vectorized(params, fn)``: each parameter's gradient becomes ``fn(full_grad, param)``;
  the same collectives as a get and a set per parameter (DeepSpeed batches them per group at ZeRO-3).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hf_zero.comm import all_gather_packed
from hf_zero.zero.sharded_group import comm_group

if TYPE_CHECKING:
    from hf_zero.zero.optimizer import ZeroOptimizer
    from hf_zero.zero.sharded_group import ShardedGroup

__all__ = ["track", "fragment_of", "safe_update_full_grad_vectorized",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]


class _Fragment:
    """Where one parameter lives: its optimizer (weakly: the registry must not keep a dropped engine alive, and
    the optimizer's groups hold the parameter itself), the group and the parameter's position in it."""

    __slots__ = ("_optimizer", "group_index", "index")

    def __init__(self, optimizer: "ZeroOptimizer", group_index: int, index: int):
        self._optimizer = weakref.ref(optimizer)
        self.group_index = group_index
        self.index = index  # the parameter's position in group.params / group.layout

    @property
    def optimizer(self) -> "ZeroOptimizer":
        optimizer = self._optimizer()
        if optimizer is None:
            raise RuntimeError("hf_zero: the engine that trained this parameter no longer exists")
        return optimizer

    @property
    def group(self) -> "ShardedGroup":
        return self.optimizer.groups[self.group_index]

    @property
    def span(self) -> tuple[int, int]:
        layout = self.group.layout
        return layout.offsets[self.index], layout.offsets[self.index + 1]


# parameter -> its place in the optimizer that owns it; weak both ways, so a dropped engine frees its parameters
_FRAGMENTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def track(optimizer: "ZeroOptimizer") -> None:
    """Make the parameters of ``optimizer`` reachable by the safe_* functions (the engine's optimizer calls this)."""
    for group_index, group in enumerate(optimizer.groups):
        for index, param in enumerate(group.params):
            _FRAGMENTS[param] = _Fragment(optimizer, group_index, index)


def fragment_of(param: torch.Tensor) -> _Fragment | None:
    """Where the optimizer that trains ``param`` keeps it; None when none does (frozen, no engine, engine gone).
    Unlike the safe_* functions this also answers under an optimizer offload (``group.master`` is then meta)."""
    frag = _FRAGMENTS.get(param)
    if frag is not None and frag._optimizer() is None:
        return None  # its engine is gone: the parameter is an ordinary tensor again
    return frag


def _fragment(param: torch.Tensor, what: str) -> _Fragment | None:
    return fragment_of(param)


# Under zero_optimization.offload_optimizer the master and Adam moments are the offload's (host memory, NVMe):
# read as copies of the group's whole shard and written back the same way (offload/optimizer_states.py), which
# also refreshes the 16-bit weights from a written master.
_OFFLOADED = ("master", "exp_avg", "exp_avg_sq")


def _offloaded(frag: _Fragment, name: str) -> torch.Tensor | None:
    """The group's ``name`` shard read back from the optimizer offload; None when it is not offloaded."""
    offload = frag.optimizer.offload
    if offload is None or name not in _OFFLOADED:
        return None
    return offload.state_tensors(frag.group_index)[name]


def _store_offloaded(frag: _Fragment, name: str, values: torch.Tensor, lo: int, hi: int) -> None:
    full = frag.optimizer.offload.state_tensors(frag.group_index)[name]
    full[lo:hi].copy_(values)
    frag.optimizer.offload.load_state_tensors(frag.group_index, {name: full})


def _master(frag: _Fragment) -> torch.Tensor:
    """The group's flat fp32 master shard (a copy read back from the optimizer offload)."""
    offloaded = _offloaded(frag, "master")
    return frag.group.master if offloaded is None else offloaded


def _full(frag: _Fragment, shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The full fp32 tensor (``like``'s shape) gathered from every rank's flat buffer ``shard``."""
    group = frag.group
    lo, hi = frag.span
    numel = group.layout.numels[frag.index]
    shape = _shape(like)
    if group.world_size == 1:
        return shard[lo:lo + numel].float().reshape(shape).clone()
    packed = torch.empty(group.world_size, hi - lo, dtype=shard.dtype, device=shard.device)
    all_gather_packed(packed, shard[lo:hi], group=comm_group(group, frag.optimizer.process_group))
    return packed.reshape(-1)[:numel].float().reshape(shape)


def _shape(param: torch.Tensor) -> torch.Size:
    ds_shape = getattr(param, "ds_shape", None)  # a ZeRO-3 parameter's data is a (0,) placeholder
    return torch.Size(ds_shape) if ds_shape is not None else param.shape


def _own_shard(frag: _Fragment, value: torch.Tensor) -> torch.Tensor:
    """This rank's shard (shard_numel,) of a full value, zero-padded."""
    group = frag.group
    numel = group.layout.numels[frag.index]
    flat = value.detach().reshape(-1)
    if flat.numel() != numel:
        raise ValueError(f"hf_zero: value has {flat.numel()} elements, the parameter has {numel} "
                         f"(shape {tuple(_shape(group.params[frag.index]))})")
    # where the gradient shards are: the master may be offloaded (a meta tensor then)
    out = torch.empty(frag.span[1] - frag.span[0], dtype=torch.float32, device=group.grad.device)
    group.layout.shard_of(flat.float(), frag.index, group.rank, out)
    return out


def _state(frag: _Fragment, key: str, what: str) -> torch.Tensor:
    offloaded = _offloaded(frag, key)
    if offloaded is not None:
        return offloaded
    state = frag.optimizer.state.get(frag.group.master, {})
    if key not in state:
        known = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.numel() == frag.group.shard_numel)
        if frag.optimizer.offload is not None:
            known = sorted(set(known) | {"exp_avg", "exp_avg_sq"})
        raise KeyError(f"hf_zero {what}: no optimizer state {key!r} for this parameter "
                       f"({'states: ' + ', '.join(known) if known else 'none yet: they appear at the first step'})")
    return state[key]


def _has_reduced_grad(frag: _Fragment) -> bool:
    return frag.group.grad.numel() == frag.group.shard_numel and frag.group.shard_numel > 0


def _write_weights(frag: _Fragment, shard: torch.Tensor, full: torch.Tensor | None) -> None:
    """Master shard <- ``shard``, and the model's copies with it: the 16-bit shard, and the full weights where a
    rank holds them (stages 0-2, or a ZeRO-3 parameter currently gathered/persistent)."""
    from hf_zero.offload.swapper import wait_all
    from hf_zero.zero.stage3.param import ParamState, sharded_param_of

    group = frag.group
    lo, hi = frag.span
    if frag.optimizer.offload is not None:  # the offload's master, and the 16-bit shard from it
        _store_offloaded(frag, "master", shard, lo, hi)
    else:
        group.master[lo:hi].copy_(shard)
        wait_all(group.write_param16(lo, hi, group.master[lo:hi]))
    param = group.params[frag.index]
    sp = sharded_param_of(param)
    holds_full = (sp is None and group.world_size > 1) or (sp is not None and sp.state is ParamState.AVAILABLE)
    if full is not None and holds_full:
        with torch.no_grad():
            param.data.copy_(full.reshape(param.shape))


# ---- full -------------------------------------------------------------------------------------------------------

def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    frag = _fragment(param, "safe_get_full_fp32_param")
    return None if frag is None else _full(frag, _master(frag), param)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    frag = _fragment(param, "safe_get_full_grad")
    if frag is None or not _has_reduced_grad(frag):
        return None if param.grad is None else param.grad.float().clone()
    return _full(frag, frag.group.grad, param)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    frag = _fragment(param, "safe_get_full_optimizer_state")
    if frag is None:
        return None
    state = _state(frag, optim_state_key, "safe_get_full_optimizer_state")
    return state.clone() if state.dim() == 0 else _full(frag, state, param)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    frag = _require(param, "safe_set_full_fp32_param")
    _write_weights(frag, _own_shard(frag, value), value)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    frag = _require(param, "safe_set_full_grad")
    if _has_reduced_grad(frag):
        lo, hi = frag.span
        frag.group.grad[lo:hi].copy_(_own_shard(frag, value))
        frag.group.grad_fresh = False
    else:  # not reduced yet: the value is this rank's gradient, averaged with the others' at the boundary
        param.grad = value.detach().to(param.dtype).reshape(param.shape).clone()


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    frag = _require(param, "safe_set_full_optimizer_state")
    state = _state(frag, optim_state_key, "safe_set_full_optimizer_state")
    if state.dim() == 0:
        state.copy_(value)
        return
    lo, hi = frag.span
    if _offloaded(frag, optim_state_key) is not None:
        _store_offloaded(frag, optim_state_key, _own_shard(frag, value), lo, hi)
    else:
        state[lo:hi].copy_(_own_shard(frag, value))


def safe_update_full_grad_vectorized(param_list: Sequence[torch.Tensor],
                                     update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Replace each parameter's full gradient ``g`` with ``update_func(g, param)`` (DeepSpeed's signature; the
    function gets the fp32 full gradient, see :func:`safe_get_full_grad`, and returns the new one, same shape).
    Parameters without a gradient (frozen, or no backward yet) are skipped and ``update_func`` is not called for
    them. A collective at stages 1-3 once gradients are reduced: every rank passes the same list."""
    for param in param_list:
        if not param.requires_grad:
            continue
        grad = safe_get_full_grad(param)
        if grad is None:
            continue
        new = update_func(grad, param)
        if not torch.is_tensor(new) or new.numel() != grad.numel():
            raise ValueError(f"hf_zero safe_update_full_grad_vectorized: update_func returned "
                             f"{tuple(new.shape) if torch.is_tensor(new) else type(new).__name__} for a gradient of "
                             f"shape {tuple(grad.shape)}; it must return a tensor of the gradient's shape")
        safe_set_full_grad(param, new)


# ---- local (this rank's shard) ----------------------------------------------------------------------------------

def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    frag = _fragment(param, "safe_get_local_fp32_param")
    return None if frag is None else _master(frag)[slice(*frag.span)].clone()


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    frag = _fragment(param, "safe_get_local_grad")
    if frag is None or not _has_reduced_grad(frag):
        return None
    return frag.group.grad[slice(*frag.span)].float().clone()


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    frag = _fragment(param, "safe_get_local_optimizer_state")
    if frag is None:
        return None
    state = _state(frag, optim_state_key, "safe_get_local_optimizer_state")
    return state.clone() if state.dim() == 0 else state[slice(*frag.span)].clone()


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    frag = _require_local(param, "safe_set_local_fp32_param")
    _write_weights(frag, _local_value(frag, value), None)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    frag = _require_local(param, "safe_set_local_grad")
    if not _has_reduced_grad(frag):
        raise RuntimeError("hf_zero safe_set_local_grad: the gradient has not been reduced yet (call it after "
                           "engine.backward at the accumulation boundary)")
    frag.group.grad[slice(*frag.span)].copy_(_local_value(frag, value))
    frag.group.grad_fresh = False


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    frag = _require_local(param, "safe_set_local_optimizer_state")
    state = _state(frag, optim_state_key, "safe_set_local_optimizer_state")
    if state.dim() == 0:
        state.copy_(value)
    elif _offloaded(frag, optim_state_key) is not None:
        _store_offloaded(frag, optim_state_key, _local_value(frag, value), *frag.span)
    else:
        state[slice(*frag.span)].copy_(_local_value(frag, value))


def _require(param: torch.Tensor, what: str) -> _Fragment:
    frag = _fragment(param, what)
    if frag is None:
        raise ValueError(f"hf_zero {what}: this parameter is not trained by an hf_zero engine's optimizer (frozen, "
                         "or not passed to initialize())")
    return frag


def _require_local(param: torch.Tensor, what: str) -> _Fragment:
    from hf_zero.zero.stage3.param import is_sharded

    frag = _require(param, what)
    if not is_sharded(param):
        full_name = what.replace("_local_", "_full_")
        raise ValueError(f"hf_zero {what}: at ZeRO stages 0-2 every rank holds the full weights, so writing one "
                         f"rank's shard would leave the ranks disagreeing; use {full_name} (DeepSpeed defines the "
                         "local setters for ZeRO-3 shards only)")
    return frag


def _local_value(frag: _Fragment, value: torch.Tensor) -> torch.Tensor:
    lo, hi = frag.span
    flat = value.detach().reshape(-1)
    if flat.numel() != hi - lo:
        raise ValueError(f"hf_zero: a local value must be this rank's shard of {hi - lo} elements "
                         f"(safe_get_local_* returns one), got {flat.numel()}")
    return flat
