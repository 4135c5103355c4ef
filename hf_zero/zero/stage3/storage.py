"""Where a ZeRO-3 shard's values live: the :class:`ShardStorage` interface, and :class:`ResidentStorage`.

A :class:`~hf_zero.zero.stage3.param.ShardedParam` reads and writes its ``(shard_numel,)`` values only through its
storage, so no caller asks where they are::

    ResidentStorage    a tensor in memory (CPU or accelerator); it may be a view of the engine's flat 16-bit
                       buffer (rebind). After a cast to the compute dtype it keeps the fp32 values it was built
                       with, which the fp32 master weights start from, until the first optimizer step.
    swapped storage    this rank's swap files (``offload_param: nvme``): hf_zero.offload.param_swap.SwappedShard,
                       created by a :class:`ShardStore` (the ParamSwapper) from the values handed to it.

Only two transitions change a parameter's storage, both methods of ShardedParam: ``to_swapped(store)`` hands the
values (and the fp32 original) to the store, ``to_resident()`` takes them back. Who may free the bytes: the
storage that holds them -- never another package reaching into the parameter.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import torch

__all__ = ["ShardStorage", "ResidentStorage", "ShardStore", "done_future"]


def done_future() -> Future:
    """A finished Future: what a storage returns for a transfer that completed on the spot."""
    f: Future = Future()
    f.set_result(None)
    return f


@runtime_checkable
class ShardStorage(Protocol):
    """The values of one rank's shard of one parameter, ``numel`` elements of ``dtype``.

    A protocol, so that hf_zero.offload (a lower layer) implements it without importing zero."""

    swapped: bool  # for accounting (bytes on the drive); value access never depends on it

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def local(self) -> torch.Tensor:
        """The values as a resident tensor, or an empty ``(0,)`` one of ``dtype`` when they are not in memory
        (what ``param.ds_tensor`` shows)."""

    def values(self) -> torch.Tensor:
        """The current values (numel,): the resident tensor itself, or a copy read back."""

    def read_async(self, out: torch.Tensor, lo: int = 0) -> Future:
        """Fill ``out`` with elements ``[lo, lo + out.numel())``."""

    def write_async(self, values: torch.Tensor, lo: int = 0) -> Future:
        """Store ``values`` (cast to ``dtype``) as elements ``[lo, lo + values.numel())``."""

    def read_initial_fp32(self, out: torch.Tensor, lo: int = 0) -> None:
        """``out`` (fp32) <- elements ``[lo, ...)`` of the values before any cast to the compute dtype."""

    def cast(self, dtype: torch.dtype) -> None:
        """Hold the values in ``dtype`` from now on; the first cast keeps the fp32 original."""

    def drop_initial(self) -> None:
        """Forget the fp32 original (after the first optimizer step the masters are the truth)."""

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Move out: ``(values, fp32 original or None)`` as resident tensors; this storage is empty afterwards."""

    def rebind(self, view: torch.Tensor, *, copy: bool = True) -> None:
        """Hold the values in ``view`` (numel,) from now on, e.g. a slice of the engine's flat buffer (``copy``:
        copy them there first); a storage whose values are not in memory raises ValueError."""


@runtime_checkable
class ShardStore(Protocol):
    """Off-memory storage for shards (hf_zero.offload.param_swap.ParamSwapper implements it)."""

    def store(self, key: str, values: torch.Tensor, initial_fp32: torch.Tensor | None, *,
              label: str) -> ShardStorage:
        """Take ``values`` (and the fp32 original) under ``key``; ``label`` names the parameter in errors."""


class ResidentStorage:
    """Values in memory; see the module docstring."""

    swapped = False

    def __init__(self, tensor: torch.Tensor, initial_fp32: torch.Tensor | None = None) -> None:
        self._tensor = tensor          # 1D (numel,)
        self._initial = initial_fp32   # 1D (numel,) fp32, or None when the values were never cast

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    @property
    def device(self) -> torch.device:
        return self._tensor.device

    @property
    def local(self) -> torch.Tensor:
        return self._tensor

    def values(self) -> torch.Tensor:
        return self._tensor

    def read_async(self, out: torch.Tensor, lo: int = 0) -> Future:
        out.copy_(self._tensor[lo:lo + out.numel()])
        return done_future()

    def write_async(self, values: torch.Tensor, lo: int = 0) -> Future:
        self._tensor[lo:lo + values.numel()].copy_(values)
        return done_future()

    def read_initial_fp32(self, out: torch.Tensor, lo: int = 0) -> None:
        src = self._initial if self._initial is not None else self._tensor
        out.copy_(src[lo:lo + out.numel()])

    def cast(self, dtype: torch.dtype) -> None:
        if self._tensor.dtype == dtype:
            return
        if self._initial is None:
            self._initial = self._tensor.float()
        self._tensor = self._tensor.to(dtype)

    def drop_initial(self) -> None:
        self._initial = None

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = (self._tensor, self._initial)
        self._tensor, self._initial = torch.empty(0, dtype=self._tensor.dtype, device=self._tensor.device), None
        return out

    def rebind(self, view: torch.Tensor, *, copy: bool = True) -> None:
        if copy:
            view.copy_(self._tensor)
        self._tensor = view
