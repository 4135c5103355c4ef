"""``GatheredParameters``: full parameters inside a block; ``register_external_parameter``;
``unwrap_model_for_generation``: the whole model gathered once for ``generate()``.

    with GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.normal_()        # on exit rank 0's values are broadcast and re-partitioned

Ordinary (never partitioned) tensors pass through untouched, as transformers relies on when it resizes embeddings.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from .stage3.gather import gatherer_for
from .stage3.param import HoldReason, ParamState, ShardedParam, sharded_param_of
from .stage3.runtime import EXTERNAL_PARAMS_ATTR, Stage3Runtime, bump_external_version

__all__ = ["GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "unwrap_model_for_generation"]


def _as_list(params) -> list:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, dict):
        return list(params.values())
    return list(params)


class GatheredParameters:
    """Gather ``params`` (one tensor or an iterable) for the duration of the block.

    :param modifier_rank: None -- edits made inside are discarded on exit; an int -- that rank's values of the
        full parameters are broadcast to every rank and become the new shards.
    :param fwd_module: accepted for DeepSpeed compatibility. hf_zero does not need it: the block holds the
        parameters, so hooks of a forward running inside it neither gather nor free them again.
    :param enabled: False makes the block a no-op.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        seen: set[int] = set()
        sps: list[ShardedParam] = []
        for p in _as_list(params):
            sp = sharded_param_of(p) if isinstance(p, torch.Tensor) else None
            if sp is not None and sp.ds_id not in seen:
                seen.add(sp.ds_id)
                sps.append(sp)
        # Every rank must gather in the same order; ds_ids are assigned in construction order on every rank.
        self._sps = sorted(sps, key=lambda sp: sp.ds_id)
        self._gathered: list[ShardedParam] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled or not self._sps:
            return self
        gatherer = gatherer_for(self._sps[0].group)
        for sp in self._sps:
            gatherer.wait_available(sp)
        need = [sp for sp in self._sps if sp.state is ParamState.PARTITIONED]
        if need:
            names = ", ".join(sp.name for sp in need[:4]) + (" ..." if len(need) > 4 else "")
            # with a modifier rank the edits are meant for the shards: in a world of one they may land there
            # directly; without one they are discarded on exit, so the block works on a copy
            gatherer.gather(need, f"GatheredParameters([{names}])", header_check=True,
                            alias=self.modifier_rank is not None)
        gatherer.check_deferred()  # (GPU) every rank gathered the same parameters before the block reads them
        self._gathered = need
        for sp in self._sps:
            sp.acquire(HoldReason.BLOCK)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled or not self._sps:
            return
        gatherer = gatherer_for(self._sps[0].group)
        # After an exception nothing is published: the block most likely failed on every rank alike, and a
        # broadcast that only some ranks reach would hang.
        if self.modifier_rank is not None and exc_type is None:
            self._publish_edits(self._sps[0].group)
        for sp in self._sps:
            sp.release(HoldReason.BLOCK)
        for sp in self._gathered:
            if sp.holders == 0:
                gatherer.release(sp)
        self._gathered = []

    def _publish_edits(self, group) -> None:
        # The values to keep are whatever the Parameter holds now (the block may have rebound ``.data``).
        src = self.modifier_rank if group is None else dist.get_global_rank(group, self.modifier_rank)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        with torch.no_grad():
            fulls = [sp.data.reshape(-1) for sp in self._sps]
            for sp, full in zip(self._sps, fulls):
                if full.numel() != sp.numel:
                    raise ValueError(f"{sp.name}: its full data has {full.numel()} elements inside "
                                     f"GatheredParameters, expected {sp.numel} (shape {tuple(sp.shape)}); "
                                     f"changing a partitioned parameter's shape is not supported")
            if world > 1:
                flat = torch.cat([f.to(self._sps[0].dtype) for f in fulls])
                dist.broadcast(flat, src=src, group=group)
                offset = 0
                for sp, full in zip(self._sps, fulls):
                    full.copy_(flat[offset:offset + sp.numel])
                    offset += sp.numel
            for sp in self._sps:
                sp.data = sp.data.reshape(sp.shape)
                sp.update_shard_from_full()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """``parameter`` is used in ``module``'s forward although another module owns it: gather it with ``module``."""
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(f"register_external_parameter expects a tensor, got {type(parameter).__name__}")
    params = module.__dict__.setdefault(EXTERNAL_PARAMS_ATTR, [])
    if not any(p is parameter for p in params):
        params.append(parameter)
        bump_external_version()


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    params = module.__dict__.get(EXTERNAL_PARAMS_ATTR, [])
    kept = [p for p in params if p is not parameter]
    if len(kept) != len(params):
        module.__dict__[EXTERNAL_PARAMS_ATTR] = kept
        bump_external_version()


@contextlib.contextmanager
def unwrap_model_for_generation(model: nn.Module):
    """DeepSpeed's (``deepspeed.runtime.zero.stage3``): for the block, every ZeRO-3 parameter of ``model`` (the
    engine) is gathered once and the engine's forward hooks are off, so ``model.generate(...)`` runs each of its
    forwards as an unpartitioned model would, with no per-module gathers. On exit the hooks come back and the
    parameters are partitioned again; edits made inside are discarded (as DeepSpeed's). Yields ``model``. A
    collective on entry and exit under ZeRO-3 (call on every rank); without ZeRO-3 it just yields ``model``.

    Memory: the whole model's 16-bit weights on every rank for the duration, as DeepSpeed. A module that is not an
    engine but has partitioned parameters (built under ``zero.Init``) is gathered the same way; with no engine to
    ask, its hooks (if any) stay, and find everything gathered."""
    params = list(model.parameters())
    runtime = getattr(model, "stage3", None)  # the engine's ZeRO-3 runtime
    runtime = runtime if isinstance(runtime, Stage3Runtime) else None
    if runtime is None and not any(sharded_param_of(p) is not None for p in params):
        yield model
        return
    if runtime is not None:
        runtime.suspend_module_hooks()
    try:
        with GatheredParameters(params):
            yield model
    finally:
        if runtime is not None:
            runtime.resume_module_hooks()
