"""One partitioned parameter: :class:`ShardedParam` and its :class:`ParamState`.

The visible ``nn.Parameter`` stays registered on its module(s), so FQNs, ``named_parameters()`` and optimizer
param groups keep working. What changes is its ``.data``::

    PARTITIONED  param.data = placeholder (0,)        the shard (shard_numel,) in ``storage`` is the only copy
    GATHERING    param.data = placeholder (0,)        an all-gather into a packed buffer is in flight
    AVAILABLE    param.data = full (shape) view       of a flat (numel,) buffer unpacked from the all-gather

A *persistent* parameter (``numel <= param_persistence_threshold``, within ``model_persistence_threshold`` in total:
``hf_zero.config.policies.persistent_parameters``) is AVAILABLE for its whole life: every rank
keeps the full tensor, and its shard is only what the optimizer updates (the runtime re-publishes it).

Where the shard's bytes live is the parameter's ``storage`` (:mod:`.storage`): resident in memory, or in this
rank's swap files (``offload_param: nvme``). Every read and write goes through it (:meth:`ShardedParam.shard_values`,
:meth:`~ShardedParam.store_shard`, ``storage.read_async``), so no caller asks where the values are; only
:meth:`~ShardedParam.to_swapped` and :meth:`~ShardedParam.to_resident` move them. ``local_shard`` is the resident
tensor (an empty one of the shard's dtype while swapped), kept for what transformers reads as ``ds_tensor``.

Only the ``to_<state>()`` methods change ``state``, and each asserts the state it leaves. The ``ds_*`` attributes
that transformers and peft read (``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_tensor``, ``ds_status``) are written
onto the Parameter by :meth:`ShardedParam._publish_compat` -- a compatibility layer, never read back internally.
The way from a Parameter to its ShardedParam is one attribute, see :func:`sharded_param_of`.
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from hf_zero.comm import buffer_pool
from hf_zero.comm.device import accelerator_device
from hf_zero.zero.layout import ShardLayout, param_shard_numel
from hf_zero.zero.local import local_grad, local_tensor

from .storage import ResidentStorage, ShardStorage, ShardStore

if TYPE_CHECKING:
    from .gather import PendingGather

__all__ = ["HoldReason", "ParamState", "ShardedParam", "sharded_param_of", "is_sharded", "values_from_group_rank0"]

# A gathered parameter's buffer comes from comm/buffer_pool.py when a kept buffer is at most this much larger: it
# lives as long as the parameter is gathered (and, parked, until the end of the step), so slack would be resident.
GATHERED_FIT = 0.75

SHARDED_PARAM_ATTR = "_hf_zero_sharded"  # the only internal attribute hf_zero sets on an nn.Parameter
_next_ds_id = itertools.count()


class ParamState(enum.Enum):
    PARTITIONED = "PARTITIONED"
    GATHERING = "GATHERING"
    AVAILABLE = "AVAILABLE"


class HoldReason(enum.Enum):
    """Why a parameter must stay whole; a leak report names the reason that was never released."""

    FORWARD = "forward"                 # its module's forward (or recomputation) is running
    BACKWARD = "backward"               # its module's backward is running
    GRAD_PENDING = "gradient pending"   # its gradient has not been accumulated yet (AccumulateGrad still to run)
    BLOCK = "GatheredParameters block"  # a user's GatheredParameters block
    READ = "read outside its module"    # read in a forward without calling its module, held until backward ends


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names for the states, as ``param.ds_status`` shows them."""

    NOT_AVAILABLE = 1
    INFLIGHT = 2
    AVAILABLE = 3


_DS_STATUS = {ParamState.PARTITIONED: ZeroParamStatus.NOT_AVAILABLE, ParamState.GATHERING: ZeroParamStatus.INFLIGHT,
              ParamState.AVAILABLE: ZeroParamStatus.AVAILABLE}


def sharded_param_of(param: torch.Tensor) -> "ShardedParam | None":
    return getattr(param, SHARDED_PARAM_ATTR, None)


def values_from_group_rank0(param: torch.Tensor, group, device: torch.device | None = None) -> torch.Tensor:
    """Before a parameter is cut into shards, every rank must hold the same values: the group's rank 0's (DeepSpeed
    broadcasts each parameter before partitioning it, in zero.Init as at initialize). Broadcast as bytes, as
    DeepSpeed sends them (any dtype -- fp8, a packed quantized weight -- over any backend). Returns the tensor now
    holding them: this rank's own (in place), or, when ``device`` differs, a contiguous copy there."""
    import torch.distributed as dist

    values = local_tensor(param).data
    if device is not None and values.device != device:
        values = values.to(device)
    if not values.is_contiguous():
        values = values.contiguous()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        dist.broadcast(values.reshape(-1).view(torch.uint8), src=src, group=group)
    return values


def is_sharded(param: torch.Tensor) -> bool:
    return sharded_param_of(param) is not None


class ShardedParam:
    """Rank ``rank``'s shard of one parameter and the state of its full copy. See the module docstring."""

    param: nn.Parameter          # ND when AVAILABLE, (0,) otherwise; registered on its module(s)
    storage: ShardStorage        # the shard: 1D (shard_numel,), zero-padded past the parameter's end on the last
                                 # ranks; resident or swapped (see the module docstring)
    grad_storage: torch.Tensor | None  # 1D (shard_numel,) where reduced gradient shards are added, or None
    _full: torch.Tensor | None   # 1D (numel,) while AVAILABLE

    def __init__(self, param: nn.Parameter, name: str, *, rank: int, world_size: int, group=None,
                 dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        if sharded_param_of(param) is not None:
            raise ValueError(f"parameter {name!r} is already partitioned")
        self.param = param
        # what the parameter computes with: the Parameter itself, or a tensor-parallel DTensor's local shard --
        # ZeRO-3 partitions what this rank holds over the data-parallel group, and its ``.data`` is what is rebound
        self._target = local_tensor(param)
        self.name = name
        self.shape = self._target.shape
        self.numel = self._target.numel()
        self.rank, self.world_size, self.group = rank, world_size, group
        self.shard_numel = param_shard_numel(self.numel, world_size)
        self.layout = ShardLayout((self.numel,), world_size)
        self.ds_id = next(_next_ds_id)
        self.persistent = False
        # decided persistent at start-up (numel <= the threshold, or ZeRO-3 alone in a world of one), gathered at
        # the first forward: `persistent` turns True then (see Stage3Runtime._publish_persistent)
        self.persist_planned = False
        self.state = ParamState.AVAILABLE
        self._holds = {reason: 0 for reason in HoldReason}  # uses currently needing the full data, by reason
        self.pending: PendingGather | None = None
        self.grad_storage = None
        # grad_storage holds zeros nobody wrote since (set by its optimizer group after clearing it): the first
        # reduced shard is copied in instead of added, so pages handed back to the kernel are not read first
        self.grad_zeroed = False
        flat = self._target.data.detach().reshape(-1)
        # ``device``: where the shard lives (zero.Init: the training GPU, while the module was built on the CPU)
        shard = torch.empty(self.shard_numel, dtype=dtype or param.dtype, device=device or param.device)
        self.layout.shard_of(flat, 0, rank, shard)
        self.storage = ResidentStorage(shard)
        self._full = None
        # the full view is the resident shard itself (a world of one, see Gatherer.gather): nothing was copied,
        # so a release frees nothing and a re-bound shard takes the view with it
        self._aliased = False
        self._parked: torch.Tensor | None = None  # the last full buffer, storage freed; see to_partitioned(park)
        setattr(param, SHARDED_PARAM_ATTR, self)
        self.to_partitioned()

    # ------------------------------------------------------------------ engine contract
    @property
    def data(self) -> torch.Tensor:
        """The tensor the Parameter computes with (a DTensor parameter's local shard): the full values while
        AVAILABLE, the empty placeholder otherwise. Assigning rebinds it."""
        return self._target.data

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self._target.data = value

    @property
    def grad(self) -> torch.Tensor | None:
        """The Parameter's gradient as this rank holds it (a DTensor gradient in the parameter's layout, local)."""
        return None if self.param.grad is None else local_grad(self.param)

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def local_shard(self) -> torch.Tensor:
        """The resident shard tensor, or an empty one of the shard's dtype while it is swapped (``ds_tensor``)."""
        return self.storage.local

    @property
    def swapped(self) -> bool:
        return self.storage.swapped

    def read_initial_fp32(self, out: torch.Tensor, lo: int = 0) -> None:
        """``out`` (fp32) <- elements ``[lo, lo + out.numel())`` of the shard's values before any cast to the
        compute dtype: what the fp32 master weights start from."""
        self.storage.read_initial_fp32(out, lo)

    def initial_fp32_shard(self) -> torch.Tensor:
        """The shard's values before any cast to the compute dtype, as a new fp32 (shard_numel,) tensor."""
        out = torch.empty(self.shard_numel, dtype=torch.float32, device=self.storage.device)
        self.read_initial_fp32(out)
        return out

    def shard_values(self) -> torch.Tensor:
        """The shard's current values (shard_numel,): the resident tensor itself, or a copy read back."""
        return self.storage.values()

    def store_shard(self, values: torch.Tensor, lo: int = 0) -> None:
        """Replace elements ``[lo, lo + values.numel())`` of the shard (cast to its dtype), wherever it lives."""
        self.storage.write_async(values, lo).result()

    def cast_shard(self, dtype: torch.dtype) -> None:
        """Store the shard (and the full data of a persistent param) in ``dtype``; keep the fp32 original."""
        if self.dtype == dtype:
            return
        self.storage.cast(dtype)
        if self.state is ParamState.AVAILABLE:
            self._set_full(self.storage.local[:self.numel] if self._aliased else self._full.to(dtype))
        else:
            self.data = self._placeholder()
        self._publish_compat()

    def drop_initial_fp32_shard(self) -> None:
        self.storage.drop_initial()

    def use_shard_storage(self, view: torch.Tensor, *, copy: bool = True) -> None:
        """From now on the resident shard *is* ``view`` (shard_numel,), e.g. a slice of the engine's flat buffer.
        ``copy=False``: ``view`` holds the values already (the buffer it belongs to was moved as a whole)."""
        if view.shape != (self.shard_numel,):
            raise ValueError(f"{self.name}: shard storage must have shape ({self.shard_numel},), got "
                             f"{tuple(view.shape)}")
        try:
            self.storage.rebind(view, copy=copy)
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None
        if self._aliased:  # the full view follows the shard into its new storage
            self._set_full(self.storage.local[:self.numel])
        self._publish_compat()

    # ------------------------------------------------------------------ placement transitions
    def to_swapped(self, store: ShardStore) -> None:
        """Hand the shard's values (and their fp32 original) to ``store``; nothing stays in memory. A shard that is
        swapped already stays where it is."""
        if self.storage.swapped:
            return
        assert not self.persistent, f"{self.name} is persistent and stays in memory"
        values, initial = self.storage.take()
        self.storage = store.store(f"p{self.ds_id}", values, initial, label=self.name)
        self._publish_compat()

    def to_resident(self) -> None:
        """Bring a swapped shard (and its fp32 original) back into memory; a resident shard stays as it is."""
        if not self.storage.swapped:
            return
        values, initial = self.storage.take()
        self.storage = ResidentStorage(values, initial)
        self._publish_compat()

    def to_device(self, device: torch.device) -> bool:
        """Move a resident shard (and its fp32 original) to ``device``: the engine puts shards that zero.Init cut
        on the CPU onto the device it trains on. Only before training starts: the parameter is PARTITIONED and its
        shard is not yet a view of the engine's flat buffers. Returns whether it moved (a swapped shard or one on
        ``device`` already stays)."""
        if self.storage.swapped or self.storage.device == torch.device(device):
            return False
        assert self.state is ParamState.PARTITIONED, f"{self.name}: to_device while {self.state.name}"
        values, initial = self.storage.take()
        self.storage = ResidentStorage(values.to(device), None if initial is None else initial.to(device))
        self.data = self._placeholder()
        self._publish_compat()
        return True

    def use_grad_storage(self, view: torch.Tensor) -> None:
        """Reduced gradient shards are added into ``view`` (shard_numel,) from now on."""
        if view.shape != (self.shard_numel,):
            raise ValueError(f"{self.name}: grad storage must have shape ({self.shard_numel},), got "
                             f"{tuple(view.shape)}")
        if not self.requires_grad:
            raise ValueError(f"{self.name} is frozen (requires_grad=False) and has no gradient storage")
        self.grad_storage = view
        self.grad_zeroed = False

    # ------------------------------------------------------------------ holds
    @property
    def holders(self) -> int:
        """How many uses currently need the full data (every reason)."""
        return sum(self._holds.values())

    def acquire(self, reason: HoldReason) -> None:
        self._holds[reason] += 1

    def release(self, reason: HoldReason) -> bool:
        """Drop one hold taken for ``reason``; True when nothing holds the parameter any more."""
        assert self._holds[reason] > 0, f"{self.name}: {reason.value} hold released more often than taken"
        self._holds[reason] -= 1
        return self.holders == 0

    def drop_holds(self) -> None:
        """Between iterations: forget every hold of the training step (what a stopped recomputation or an unused
        backward path left); a user's GatheredParameters blocks keep theirs."""
        for reason in HoldReason:
            if reason is not HoldReason.BLOCK:
                self._holds[reason] = 0

    def describe_holds(self) -> str:
        return ", ".join(f"{r.value} x{n}" for r, n in self._holds.items() if n) or "none"

    # ------------------------------------------------------------------ state transitions
    def to_gathering(self, pending: "PendingGather") -> None:
        assert self.state is ParamState.PARTITIONED, f"{self.name}: to_gathering from {self.state.name}"
        self.pending = pending
        self.state = ParamState.GATHERING
        self._publish_compat()

    def can_alias_shard(self, device: torch.device) -> bool:
        """Whether the shard alone is the whole parameter, in memory on ``device``: a world of one, not swapped."""
        return (self.world_size == 1 and not self.storage.swapped and self.storage.device == device
                and self.shard_numel == self.numel)

    def to_available(self, full_flat: torch.Tensor | None) -> None:
        """``full_flat`` (numel,) holds the whole parameter; the Parameter becomes a view of it. None: the shard
        is the whole parameter (:meth:`can_alias_shard`) and the Parameter becomes a view of the shard itself --
        edits then reach the shard directly."""
        assert self.state in (ParamState.PARTITIONED, ParamState.GATHERING), \
            f"{self.name}: to_available from {self.state.name}"
        self.pending = None
        self._aliased = full_flat is None
        self._set_full(self.storage.local[:self.numel] if full_flat is None else full_flat)
        self.state = ParamState.AVAILABLE
        self._publish_compat()

    def to_partitioned(self, *, park: bool = False) -> None:
        """Drop the full copy. The values that count are in ``local_shard``; edits made to the full copy are lost
        (GatheredParameters with a modifier rank writes them back before calling this).

        ``park`` (releases during the forward pass): also free the full buffer's *storage* in place and remember
        the buffer, so the next gather refills that same storage (:meth:`take_parked`). Autograd saved views of
        the weight in forward (``linear`` saves ``weight.t()``), which would otherwise keep every layer's full
        weight alive until backward; with the storage freed they cost nothing, and the backward's re-gather makes
        them valid again before they are used. Without ``park`` (releases in backward) only ``.data`` is rebound:
        an alias saved by activation checkpointing must stay valid until its backward has used it.
        """
        assert self.state is ParamState.AVAILABLE, f"{self.name}: to_partitioned from {self.state.name}"
        assert not self.persistent, f"{self.name} is persistent and never partitioned"
        assert self.holders == 0, f"{self.name}: partitioned while users still need it ({self.describe_holds()})"
        full = None if self._aliased else self._full  # an aliased shard is not ours to free
        self._aliased = False
        if park and full is not None and full.storage_offset() == 0:
            buffer_pool.release_storage(full)  # the bytes go to the pool: the next gather's buffer, no fresh mmap
            self._parked = full
            full = None
        self._full = None
        self.pending = None
        self.data = self._placeholder()
        if full is not None:
            # no view of it left (autograd saved none, or freed them in backward): the next gather may reuse it
            buffer_pool.give_if_unshared(full)
        self.state = ParamState.PARTITIONED
        self._publish_compat()

    def take_parked(self) -> torch.Tensor | None:
        """The parked full buffer (see ``to_partitioned(park=True)``) with its storage allocated again, to gather
        into; None when there is none. Fill it under ``torch.autograd._unsafe_preserve_version_counter``: saved
        views see the same values again, which is not an in-place change autograd should reject."""
        full, self._parked = self._parked, None
        if full is not None:
            buffer_pool.refill_storage(full, fit=GATHERED_FIT)
        return full

    def forget_parked(self) -> None:
        """Between iterations: the graph that saved views of the parked buffer is gone."""
        self._parked = None

    def abort_gathering(self) -> None:
        """GATHERING -> PARTITIONED when the gather failed (divergence, timeout): nothing full ever existed."""
        assert self.state is ParamState.GATHERING, f"{self.name}: abort_gathering from {self.state.name}"
        self.pending = None
        self.state = ParamState.PARTITIONED
        self._publish_compat()

    def make_persistent(self) -> None:
        """Called while AVAILABLE: the full tensor stays on every rank from now on."""
        assert self.state is ParamState.AVAILABLE, f"{self.name}: make_persistent from {self.state.name}"
        self.persistent = True

    def release_persistence(self) -> None:
        self.persistent = False

    def plan_persistence(self) -> None:
        """Decided persistent while still PARTITIONED (``ds_persist`` is True from here, as DeepSpeed marks it at
        initialize); :meth:`make_persistent` follows once it is gathered."""
        self.persist_planned = True
        self._publish_compat()

    # ------------------------------------------------------------------ helpers
    @property
    def full_flat(self) -> torch.Tensor:
        assert self.state is ParamState.AVAILABLE, f"{self.name}: full data read while {self.state.name}"
        return self.data.reshape(-1)

    def update_shard_from_full(self) -> None:
        """Copy this rank's shard of the (possibly edited) full parameter into the local shard."""
        flat = self.full_flat
        with torch.no_grad():
            shard = torch.empty(self.shard_numel, dtype=self.dtype, device=self.storage.device)
            self.layout.shard_of(flat.to(self.dtype), 0, self.rank, shard)
            self.store_shard(shard)

    def store_full(self, values: torch.Tensor) -> None:
        """The whole parameter (as this rank computes with it: a DTensor's local shard) is ``values`` from now
        on: this rank's shard of it goes into the shard storage, and a full copy that is AVAILABLE is overwritten
        too. Every rank of the group is handed the same values, so no collective is needed."""
        if values.numel() != self.numel:
            raise ValueError(f"{self.name}: {values.numel()} values (shape {tuple(values.shape)}) for a parameter of "
                             f"shape {tuple(self.shape)}")
        flat = values.detach().reshape(-1)
        with torch.no_grad():
            if self.state is ParamState.AVAILABLE and not self._aliased:
                self.full_flat.copy_(flat)
            shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.storage.device)
            self.layout.shard_of(flat.to(device=shard.device, dtype=self.dtype), 0, self.rank, shard)
            self.store_shard(shard)

    def _set_full(self, full_flat: torch.Tensor) -> None:
        self._full = full_flat
        self.data = full_flat.view(self.shape)

    def _placeholder(self) -> torch.Tensor:
        # on the device the parameter is computed on -- the GPU also when offload_param keeps the shard in host
        # memory -- so that `model.device` (which transformers moves inputs to) names the GPU
        device = self.storage.device
        if device.type == "cpu":
            device = accelerator_device() or device
        return torch.empty(0, dtype=self.dtype, device=device)

    def _publish_compat(self) -> None:
        p = self.param
        p.ds_id = self.ds_id
        p.ds_shape = self.shape
        p.ds_numel = self.numel
        p.ds_tensor = self.local_shard
        p.ds_status = _DS_STATUS[self.state]
        p.ds_persist = self.persistent or self.persist_planned
        if "ds_active_sub_modules" not in p.__dict__:  # DeepSpeed's set of modules using it; TRL clears it
            p.ds_active_sub_modules = set()

    def forget(self) -> None:
        """Detach from the Parameter: no hf_zero attribute is left on it (its ``.data`` is whatever it is now)."""
        for attr in (SHARDED_PARAM_ATTR, "ds_id", "ds_shape", "ds_numel", "ds_tensor", "ds_status", "ds_persist",
                     "ds_active_sub_modules"):
            if attr in self.param.__dict__:
                delattr(self.param, attr)

    def __repr__(self) -> str:
        return (f"ShardedParam({self.name!r}, shape={tuple(self.shape)}, shard_numel={self.shard_numel}, "
                f"state={self.state.name}, persistent={self.persistent})")
