"""Stage3Runtime: partitions a module's parameters and drives gathers, releases and gradient reduction.

Each module that directly owns partitioned parameters (plus the external parameters registered on it) has a
*group*: the parameters gathered, in one collective, before its forward and again before its backward. A
parameter is held, through ``ShardedParam.acquire/release`` with a :class:`~.param.HoldReason`, by each current
use (a forward in progress, a backward in progress, a gradient still to be accumulated, a GatheredParameters
block); when the last hold is released the parameter is partitioned again unless the recorded trace says it is
needed again within ``max_reuse_distance`` elements.

Iterations start at the root module's forward pre-hook. The first iteration of each kind is recorded (see
prefetch.py) with a divergence header before every gather (see divergence.py).

Order of a training micro-step, as the engine drives it::

    out = module(x)       per module: gather (+ prefetch next) -> forward -> release
    loss.backward()       per module: gather -> backward -> release; per param: grad -> packed bucket
    rt.finish_backward()  flush/wait reduce-scatters, free everything still gathered
    optimizer.step()      (engine) updates the shards in place
    rt.after_step()       re-gather persistent params; drop stale gathered copies

A leaf module's gradients are held instead, and reduced together when its backward ends (leaf_grads.py).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from hf_zero.comm import buffer_pool, faults, get_rank, get_world_size, shm_ring
from hf_zero.config.policies import NO_PERSISTENCE_CAP, persistent_parameters
from hf_zero.util.tensors import functorch_transforming
from hf_zero.zero.host_memory import tune_cpu_training_memory
from hf_zero.zero.checkpoint_state import ShardReader
from hf_zero.zero.layout import capped_bucket_numel
from hf_zero.zero.leaf import z3_leaf_module
from hf_zero.zero.local import local_tensor

from .gather import DEFAULT_DIVERGENCE_TIMEOUT_S, gatherer_for
from .leaf_grads import LeafGradients, unused_gradient
from .hooks import (install_module_hooks, outside_graph, queue_end_of_backward, register_output_grad_hooks,
                    wrap_inputs_for_post_backward)
from .param import HoldReason, ParamState, ShardedParam, ZeroParamStatus, sharded_param_of, values_from_group_rank0
from .prefetch import GatherTrace
from .reduce import Stage3GradReducer
from .states import ModuleCall, TrainingStates

logger = logging.getLogger("hf_zero")

__all__ = ["Stage3Runtime", "external_parameters", "EXTERNAL_PARAMS_ATTR", "WatchedParameters"]

_AVAILABLE = ZeroParamStatus.AVAILABLE

EXTERNAL_PARAMS_ATTR = "_hf_zero_external_params"  # set on a module by register_external_parameter


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list(getattr(module, EXTERNAL_PARAMS_ATTR, ()))


class _DsExternalParameters:
    """DeepSpeed's ``module.ds_external_parameters()`` under ZeRO-3 (TRL calls it on the root): ``(id, parameter)``
    pairs. An instance attribute that refers to its module weakly, and copies or pickles as one that answers
    nothing: a copied module is not the runtime's (a bound method there would make ``torch.save(model)`` fail to
    load, its ``getattr`` running before the module's attributes are back)."""

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module | None) -> None:
        self._module = weakref.ref(module) if module is not None else None

    def __call__(self) -> list[tuple[int, nn.Parameter]]:
        module = self._module() if self._module is not None else None
        return [] if module is None else [(id(p), p) for p in external_parameters(module)]

    def __reduce__(self):
        return (_DsExternalParameters, (None,))

    def __deepcopy__(self, memo):
        return _DsExternalParameters(None)


class _Group:
    __slots__ = ("gid", "fqn", "sps", "numel")

    def __init__(self, gid: int, fqn: str, sps: list[ShardedParam]) -> None:
        self.gid, self.fqn, self.sps = gid, fqn, sps
        self.numel = sum(sp.numel for sp in sps)


def _refuse_functorch() -> None:
    """Called where ZeRO-3 is about to swap parameter storages (the first forward's publish, every gather of a
    partitioned model): under a torch.func transform that crashes torch, so it is an error instead."""
    if functorch_transforming():
        raise RuntimeError(
            "hf_zero: a torch.func transform (grad, vjp, jacrev, vmap) over a ZeRO-3 engine whose parameters are "
            "partitioned or not yet published: ZeRO-3 swaps each parameter's storage around its module's forward, "
            "which a function transform cannot follow (torch crashes). Use ZeRO stage 0, 1 or 2 for torch.func "
            "(as DeepSpeed supports it), or run one forward outside the transform first on a single rank, where "
            "ZeRO-3 keeps parameters whole")


class Stage3Runtime:
    """ZeRO-3 for one module tree. See the module docstring; the engine contract is in the class methods."""

    def __init__(self, module: nn.Module, *, group=None, compute_dtype: torch.dtype = torch.float32,
                 reduce_bucket_size: int = 500_000_000, prefetch_bucket_size: int = 50_000_000,
                 max_live_parameters: int = 1_000_000_000, max_reuse_distance: int = 1_000_000_000,
                 param_persistence_threshold: int = 100_000, model_persistence_threshold: int = NO_PERSISTENCE_CAP,
                 overlap_comm: bool = False,
                 grad_scale: float | None = None,
                 divergence_timeout_s: float = DEFAULT_DIVERGENCE_TIMEOUT_S, swapper=None,
                 keep_whole_alone: bool = False, log_trace_misses: bool = False) -> None:
        self.module = module
        # zero_optimization.log_trace_cache_warnings: a module asking out of the recorded order is logged
        self._log_trace_misses = log_trace_misses
        self._miss_logged = False  # once per iteration
        self.group = group
        if not torch.cuda.is_available():  # CPU training: stage 3's host memory policy (zero/host_memory.py)
            tune_cpu_training_memory(stage3=True)
            # gathered parameters and packed gradients are pooled too (param.py, _on_grad_accumulated) -- unless
            # the ranks share a host: the gathers' packed buffers then live in the shared ring (comm/shm_ring.py),
            # which takes that room, and the pool keeps the default cap
            if shm_ring.ring_for(group) is None:
                buffer_pool.raise_cap(buffer_pool.POOL_CAP_BYTES_STAGE3)
        self.rank = get_rank(group)
        self.world_size = get_world_size(group)
        self.compute_dtype = compute_dtype
        # a maximum, like the buckets: at most BUCKET_CAP_BYTES ahead (DeepSpeed's 5e7 elements would gather a
        # 32M-parameter model whole at its first module); a next module larger than that is gathered when used
        self.prefetch_numel = (capped_bucket_numel(prefetch_bucket_size, compute_dtype.itemsize)
                               if int(prefetch_bucket_size) > 0 else 0)
        self.max_live_numel = int(max_live_parameters)
        self.max_reuse_numel = int(max_reuse_distance)
        self.persistence_threshold = int(param_persistence_threshold)
        self.model_persistence_threshold = int(model_persistence_threshold)
        self.gatherer = gatherer_for(group)
        self.gatherer.timeout_s = float(divergence_timeout_s)
        # offload_param nvme (hf_zero.offload.ParamSwapper): every shard that is not persistent lives in a
        # swap file; the gathers read it from there, ahead of time when the trace says what comes next
        self.swapper = swapper
        # ``keep_whole_alone`` (the engine's choice): in a world of one whose shards all sit in memory on the compute
        # device, each shard *is* its whole parameter, so every parameter stays whole as a view of its shard (see
        # Gatherer.gather): no gathers, no module hooks, gradients added in one batch at the end of backward.
        # ZeRO-3 alone then costs what stage 0 costs, in time and memory. Set by _partition_all.
        self.whole = False
        self._keep_whole_alone = keep_whole_alone
        self._sps = self._partition_all()
        self.reducer = Stage3GradReducer(group=group, rank=self.rank, world_size=self.world_size,
                                   bucket_numel=reduce_bucket_size,
                                   grad_scale=1.0 / self.world_size if grad_scale is None else grad_scale,
                                   overlap_comm=overlap_comm, timeout_s_fn=lambda: self.gatherer.timeout_s)
        self._groups: dict[nn.Module, _Group] = {}
        self._groups_of_sp: dict[int, set[int]] = {}  # ds_id -> group ids containing it
        # leaf modules' gradients: held, then reduced together when the leaf's backward ends (leaf_grads.py); in a
        # world of one there is nobody to disagree with, and each gradient is reduced as it comes
        self.leaf_grads = (LeafGradients(self.reducer.add, self._grad_accounted,
                                         active=lambda: self._held_grads is None)
                           if self.world_size > 1 else None)
        self._build_groups()
        self.trace = self._new_trace()
        self.states = TrainingStates()  # forward / recompute / backward of each module call, see states.py
        self._read_holds: list[ShardedParam] = []  # see _on_param_read
        self._awaiting_grad: set[int] = set()  # ds_ids holding a "gradient not accumulated yet" reference
        # engine.coalesce_grad_reduction(): ds_id -> (param, its gradients summed on this rank) until the one
        # reduce-scatter pass of reduce_held_gradients(); None when gradients are reduced as they arrive
        self._held_grads: dict[int, tuple[ShardedParam, torch.Tensor]] | None = None
        self._calls_awaiting_grad: dict[int, list[ModuleCall]] = {}  # ds_id -> calls ended by its gradient
        self._end_of_backward_queued = False
        self._deferred: set[ShardedParam] = set()  # frozen params kept whole after a recomputation, see _post_forward
        self._handles = []
        self._root_handles = []  # the iteration boundary's hooks on the root (see _install_hooks)
        self._hooks_suspended = False  # suspend_module_hooks() .. resume_module_hooks()
        self._module_handles: dict[nn.Module, tuple[str, list]] = {}  # module -> ("group" | "track", hooks)
        self._install_hooks()
        self._stepped = False
        self._coalescing = False  # inside coalesced_shard_changes: shards_changed only notes the change
        self._changed = False
        # the engine's check on each arriving gradient (refuses backward passes it did not see); None: no check
        self.grad_guard: Callable[[str], None] | None = None
        self.prefetched_numel = 0  # statistics: elements gathered ahead of need

    # ------------------------------------------------------------------ set-up
    def _partition_all(self) -> list[ShardedParam]:
        sps: list[ShardedParam] = []
        seen: set[int] = set()
        fresh: list[tuple[str, nn.Parameter]] = []
        for name, p in self.module.named_parameters():  # tied parameters once, under their first name
            if id(p) in seen:
                continue
            seen.add(id(p))
            sp = sharded_param_of(p)
            if sp is None:
                fresh.append((name, p))
            else:
                sp.name = name
                sps.append(sp)
        if self.world_size > 1:  # a module not built under zero.Init: rank 0's values on every rank
            for _, p in fresh:
                values = values_from_group_rank0(p, self.group)
                if values is not local_tensor(p).data:  # made contiguous for the broadcast: back in place
                    local_tensor(p).data.copy_(values)
        for name, p in fresh:
            sps.append(ShardedParam(p, name, rank=self.rank, world_size=self.world_size, group=self.group))
        by_id = {id(sp.param): sp for sp in sps}
        sps = [by_id[id(p)] for _, p in self.module.named_parameters() if id(p) in by_id]
        for sp in sps:
            if sp.state is not ParamState.PARTITIONED:
                raise RuntimeError(f"{sp.name} is {sp.state.name} when ZeRO-3 starts; leave every "
                                   f"GatheredParameters block before initializing the engine")
        device = self.gatherer.device
        self.whole = (self._keep_whole_alone and self.world_size == 1 and self.swapper is None and bool(sps)
                      and all(sp.can_alias_shard(device or sp.storage.device) for sp in sps))
        if self.whole:
            persistent = sps
        else:
            keep = persistent_parameters([sp.numel for sp in sps], self.persistence_threshold,
                                         self.model_persistence_threshold)
            persistent = [sp for sp, k in zip(sps, keep) if k]
        for sp in persistent:
            sp.to_resident()  # zero.Init may have swapped it out; persistent parameters stay in memory
        for sp in sps:
            sp.cast_shard(self.compute_dtype)
        if self.swapper is not None:
            planned = {id(sp) for sp in persistent}
            for sp in sps:
                if id(sp) not in planned:
                    sp.to_swapped(self.swapper)
        # Decided now, gathered at the first forward (_publish_persistent): until then every parameter is a (0,)
        # placeholder, as under DeepSpeed -- code run between initialize and the first forward (peft's
        # save_pretrained checking for un-gathered adapters, a script reading ds_shape) sees what it sees there.
        for sp in persistent:
            sp.plan_persistence()
        self._unpublished = persistent
        self._publish_handles = []
        return sps

    def _publish_persistent(self) -> None:
        """Gather the parameters decided persistent at start-up, once: at the first forward of any module (every
        rank runs it, so the collective matches), or before anything that needs them whole."""
        todo, self._unpublished = self._unpublished, []
        handles, self._publish_handles = self._publish_handles, []
        for h in handles:  # pre-hooks only: removing them inside a forward leaves no call half-tracked
            h.remove()
        if not todo:
            return
        for sp in todo:
            self.gatherer.wait_available(sp)  # a GatheredParameters block may hold some of them
        need = [sp for sp in todo if sp.state is ParamState.PARTITIONED]
        if need:
            self.gatherer.gather(need, "persistent parameters", header_check=True)
        for sp in todo:
            sp.make_persistent()

    def _publish_hook(self, module, args):
        _refuse_functorch()
        self._publish_persistent()
        return None

    def _install_publish_hooks(self) -> None:
        # The root and every module owning a parameter to publish: a forward that starts at a sub-module (a direct
        # call) publishes too. Removed at the first publish.
        if not self._unpublished:
            return
        planned = {id(sp.param) for sp in self._unpublished}
        for mod in self.module.modules():
            if mod is self.module or any(id(p) in planned for p in mod._parameters.values() if p is not None):
                self._publish_handles.append(mod.register_forward_pre_hook(outside_graph(self._publish_hook),
                                                                              prepend=True))

    def _build_groups(self) -> None:
        self._groups.clear()
        self._groups_of_sp.clear()
        leaf_prefixes: list[str] = []
        leaf_members: dict[nn.Module, list[ShardedParam]] = {}
        for fqn, mod in self.module.named_modules():
            if any(fqn.startswith(prefix) for prefix in leaf_prefixes):
                continue  # inside a leaf module: gathered with it
            leaf = z3_leaf_module(mod)
            if leaf:
                leaf_prefixes.append(f"{fqn}." if fqn else "")
                own = list(mod.parameters()) + [p for m in mod.modules() for p in external_parameters(m)]
                leaf_members[mod] = [sp for p in mod.parameters() if (sp := sharded_param_of(p)) is not None]
            else:
                own = list(mod._parameters.values()) + external_parameters(mod)
            members: list[ShardedParam] = []
            for p in own:
                sp = sharded_param_of(p) if p is not None else None
                if sp is not None and leaf:
                    p.ds_z3_leaf_module = mod
                if sp is not None and not sp.persist_planned and sp not in members:
                    members.append(sp)
            if members:
                g = _Group(len(self._groups), fqn or "<root>", members)
                self._groups[mod] = g
                for sp in members:
                    self._groups_of_sp.setdefault(sp.ds_id, set()).add(g.gid)
                self.gatherer.register_label(members, f"module {g.fqn!r}")
        self._group_by_gid = {g.gid: g for g in self._groups.values()}
        self._external_version = _external_version()
        if self.leaf_grads is not None and not self.whole:
            self.leaf_grads.rebuild(leaf_members)

    def _install_hooks(self) -> None:
        # Registered after the root's group hooks: the iteration boundary runs before the root's own gather
        # (prepend) and after its release (append). These and the gradient hooks live as long as the runtime.
        for mod in self.module.modules():  # DeepSpeed's method on every ZeRO-3 module (scripts and TRL call it)
            mod.__dict__["ds_external_parameters"] = _DsExternalParameters(mod)
        self._install_publish_hooks()
        if self.whole:  # nothing is partitioned after the first forward: no other hook has anything to do
            return
        self._sync_module_hooks()
        self._install_root_hooks()
        for sp in self._sps:
            if sp.requires_grad:
                self._handles.append(sp.param.register_post_accumulate_grad_hook(self._on_grad_accumulated))

    def _install_root_hooks(self) -> None:
        self._root_handles = [self.module.register_forward_pre_hook(outside_graph(self._root_pre_forward),
                                                                    prepend=True),
                              self.module.register_forward_hook(outside_graph(self._root_post_forward))]

    def hooked_module_variants(self) -> int:
        """Distinct (module class, own parameters' shapes and requires_grad) among the modules with gather hooks.
        Under torch.compile each such module's forward is a graph of its own, compiled once per variant of its
        class's code (a LoRA model's frozen and trainable linears of each shape): what dynamo's recompile limit must
        allow for none of them to fall back to eager (Engine.compile)."""
        return len({(type(mod).__qualname__, tuple((tuple(sp.shape), sp.requires_grad) for sp in g.sps))
                    for mod, g in self._groups.items()})

    @property
    def hooks_suspended(self) -> bool:
        """Inside :meth:`suspend_module_hooks` .. :meth:`resume_module_hooks` (an ``unwrap_model_for_generation``
        block): every parameter is held gathered."""
        return self._hooks_suspended

    def suspend_module_hooks(self) -> None:
        """Take every forward hook off the model (``unwrap_model_for_generation``, whose block holds every parameter
        gathered: the hooks would have nothing to gather, and cost a call per module per generated token). The
        parameters decided persistent are published first (a collective: call on every rank). The gradient hooks
        stay. :meth:`resume_module_hooks` puts the hooks back."""
        if self._hooks_suspended:
            raise RuntimeError("hf_zero ZeRO-3: unwrap_model_for_generation is already active for this engine (the "
                               "blocks cannot be nested: the inner one's exit would partition what the outer holds)")
        if self.states.any_open():
            raise RuntimeError("hf_zero ZeRO-3: unwrap_model_for_generation inside the model's forward; enter it "
                               "between training steps")
        self._publish_persistent()
        for h in self._root_handles + [h for _, hs in self._module_handles.values() for h in hs]:
            h.remove()
        self._root_handles = []
        self._module_handles.clear()
        self._hooks_suspended = True

    def resume_module_hooks(self) -> None:
        """Undo :meth:`suspend_module_hooks`: the hooks of the current groups (leaf flags changed meanwhile apply
        from the next forward, as always)."""
        if not self._hooks_suspended:
            raise RuntimeError("hf_zero ZeRO-3: resume_module_hooks without suspend_module_hooks")
        self._hooks_suspended = False
        if self.whole:  # it never had module hooks (see _install_hooks)
            return
        self._sync_module_hooks()
        self._install_root_hooks()

    def _sync_module_hooks(self) -> None:
        """Hooks on exactly the modules that have a group now, or that only track their forward. A module keeping
        either keeps its hooks, which decide at each call which it is (:meth:`_module_pre_forward`): a rebuild runs
        inside the root's forward pre-hooks, whose list torch has already taken, so a hook replaced there would
        still be called -- a removed one with the wrong arguments, the new one not at all (the root turning from
        tracked into grouped after TRL's generation re-registered the hooks did exactly that)."""
        for mod in self.module.modules():
            if type(mod._parameters) is dict and any(sharded_param_of(p) is not None
                                                     for p in mod._parameters.values() if p is not None):
                mod._parameters = WatchedParameters(mod._parameters, self._on_param_read)
        wanted = {mod: "group" for mod in self._groups}
        leaves = [m for m in self.module.modules() if z3_leaf_module(m)]
        for mod in self.module.modules():
            # modules without a group but with partitioned parameters below them only record that their forward
            # runs: the innermost module in forward is then known for error messages and attribute reads
            if mod not in wanted and not any(mod is not leaf and _is_within(mod, leaf) for leaf in leaves) and \
                    any((sp := sharded_param_of(p)) is not None and not sp.persist_planned for p in mod.parameters()):
                wanted[mod] = "track"
        for mod in [m for m in self._module_handles if m not in wanted]:
            for h in self._module_handles.pop(mod)[1]:
                h.remove()
        for mod, kind in wanted.items():
            handles = self._module_handles[mod][1] if mod in self._module_handles else \
                install_module_hooks(mod, self._module_pre_forward, self._module_post_forward)
            self._module_handles[mod] = (kind, handles)

    def _module_pre_forward(self, module, args, kwargs):
        """Every hooked module's pre-forward: gather its group, or (a module without one, above partitioned
        parameters) record that its forward runs."""
        if module in self._groups:
            return self._pre_forward(module, args, kwargs)
        self.states.track(module)
        return None

    def _module_post_forward(self, module, args, output):
        if module in self._groups:
            return self._post_forward(module, args, output)
        self.states.untrack(module)
        return None

    # ------------------------------------------------------------------ engine contract
    def set_timers(self, timers) -> None:
        """Time spent blocked in gathers and gradient reduce-scatters goes to ``timers`` as "communication";
        waits for swapped shards as "offload_io"."""
        self.gatherer.timers = timers
        self.reducer.timers = timers
        if self.swapper is not None:
            self.swapper.timers = timers

    def sharded_params(self) -> list[ShardedParam]:
        return list(self._sps)

    def begin_backward(self) -> None:
        """The engine's backward prologue: from here until :meth:`finish_backward` a module's forward is an
        activation-checkpoint recomputation."""
        self.states.begin_backward()

    def finish_backward(self) -> None:
        """After ``loss.backward()``: every reduced gradient is in its grad storage; nothing stays gathered."""
        if self.whole:
            self._accumulate_whole()
            return
        self.states.end_backward()
        if self.leaf_grads is not None:
            self.leaf_grads.finish_backward()
        self.reducer.finish()
        self._reset_gathered()
        if self.swapper is not None:
            self.swapper.discard_read_ahead()  # the optimizer is about to write new values

    def hold_gradients(self) -> None:
        """From here on backward passes sum each gradient on this rank instead of reduce-scattering it, until
        :meth:`reduce_held_gradients` (``engine.coalesce_grad_reduction()``: one reduction for several backward
        passes, at the cost of holding their full gradients meanwhile)."""
        self._held_grads = {}  # leaves' gradients too: they are completed with zeros at the end

    def reduce_held_gradients(self) -> None:
        """Reduce-scatter what :meth:`hold_gradients` kept, in one pass. Every rank adds the gradients in ds_id
        order (not arrival order, which may differ between ranks), so the buckets -- and the collectives -- match."""
        held, self._held_grads = self._held_grads or {}, None
        if self.leaf_grads is not None:
            for sp in self.leaf_grads.members():  # a leaf's unused parameters count as zeros, as in its flush
                if sp.ds_id not in held:
                    held[sp.ds_id] = (sp, unused_gradient(sp))
        for ds_id in sorted(held):
            sp, grad = held.pop(ds_id)
            self.reducer.add(sp, grad)
            del grad
        self.reducer.finish()

    def drop_held_gradients(self) -> None:
        """Forget what :meth:`hold_gradients` kept, reducing nothing (the block raised)."""
        self._held_grads = None

    def _accumulate_whole(self) -> None:
        """Every parameter is whole (``self.whole``): the gradients autograd left in ``.grad`` go into the grad
        storages in one batch, and ``.grad`` is cleared, as the per-parameter hooks do when parameters are
        partitioned."""
        items = []
        for sp in self._sps:
            if sp.param.grad is not None:
                items.append((sp, sp.grad))
                sp.param.grad = None
        self.reducer.accumulate_alone(items)

    def after_step(self) -> None:
        """After the optimizer updated the shards: gathered copies are stale; persistent params are re-gathered.
        Also the end of a checkpoint load: one before the first forward publishes the persistent params with the
        loaded values (DeepSpeed's load_checkpoint leaves them whole too)."""
        if self._unpublished:
            self._reset_gathered()
            self._publish_persistent()
        if self.whole:  # the parameters are views of the shards the optimizer wrote
            if not self._stepped:
                self._stepped = True
                for sp in self._sps:
                    sp.drop_initial_fp32_shard()
            return
        self.shards_changed()
        if not self._stepped:
            self._stepped = True
            for sp in self._sps:
                sp.drop_initial_fp32_shard()

    @contextlib.contextmanager
    def coalesced_shard_changes(self):
        """Writers of shards inside the block (the optimizer's step, then ZenFlow's write-back of its selected
        columns) re-gather the persistent parameters once, at the end, instead of once each."""
        self._coalescing, self._changed = True, False
        try:
            yield
        finally:
            self._coalescing = False
        if self._changed:
            self.shards_changed()

    def shards_changed(self) -> None:
        """Shards were written outside a forward (the optimizer's step, ZenFlow's selective update after a
        backward): the gathered copies are stale, and the persistent parameters are gathered again (a collective:
        every rank calls it at the same point)."""
        if self.whole:  # the parameters are views of the shards
            return
        if self._coalescing:
            self._changed = True
            return
        self._reset_gathered()
        persistent = self._partition_persistent()
        if persistent:
            self.gatherer.gather(persistent, "persistent parameters")
            for sp in persistent:
                sp.make_persistent()

    # ------------------------------------------------------------------ checkpoint (engine)
    def shard_state(self, *, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
        """This rank's tensors the optimizer does not own, for its checkpoint file: the shards of frozen
        parameters (``stage3.frozen.<name>``, shard_numel each) and the module's persistent buffers
        (``stage3.buffer.<name>``, whole, identical on every rank). Trainable values are the optimizer's masters."""
        out: dict[str, torch.Tensor] = {}
        if not exclude_frozen:
            for sp in self._sps:
                if not sp.requires_grad:
                    out[f"stage3.frozen.{sp.name}"] = sp.shard_values()
        for name, buf in _persistent_buffers(self.module):
            out[f"stage3.buffer.{name}"] = buf
        return out

    def load_shard_state(self, reader: ShardReader) -> None:
        """Inverse of :meth:`shard_state`, through the checkpoint's reader (which re-cuts a checkpoint saved
        on another number of ranks). Call :meth:`after_step` once the optimizer has loaded its masters, to
        re-publish persistent params."""
        keys = reader.keys()
        with torch.no_grad():
            for sp in self._sps:
                key = f"stage3.frozen.{sp.name}"
                if not sp.requires_grad and key in keys:
                    sp.store_shard(reader.shard(key, sp.layout, self.rank).to(sp.dtype))
            for name, buf in _persistent_buffers(self.module):
                key = f"stage3.buffer.{name}"
                if key in keys:
                    buf.copy_(reader.whole(key))
        self._reset_gathered()

    def remove(self) -> None:
        """Remove every hook and give each rank the full parameters back as ordinary tensors.

        With shards swapped to NVMe the whole model may not fit in memory; then this refuses (before changing
        anything) instead of being killed by the OOM killer half-way."""
        swapped = sum(sp.numel * sp.dtype.itemsize for sp in self._sps if sp.swapped)
        available = _mem_available_bytes()
        if swapped and available is not None and swapped > available:
            raise MemoryError(
                f"hf_zero: giving the model back as ordinary tensors (engine.destroy) needs {swapped} bytes "
                f"({swapped / 2**30:.2f} GiB) on every rank for the parameters in offload_param's swap files, and "
                f"{available} bytes ({available / 2**30:.2f} GiB) are available. Save it instead with "
                "engine.save_16bit_model() or save_checkpoint() (both stream module by module); the swap files are "
                "removed when the process exits")
        for h in (self._handles + self._root_handles + self._publish_handles
                  + [h for _, hs in self._module_handles.values() for h in hs]):
            h.remove()
        self._root_handles = []
        self._publish_handles, self._unpublished = [], []  # gathered below with the rest; nothing left to publish
        self._handles.clear()
        self._module_handles.clear()
        if self.leaf_grads is not None:
            self.leaf_grads.remove()
        _unwatch(self.module)
        for mod in self.module.modules():
            mod.__dict__.pop("ds_external_parameters", None)
        self.reducer.finish()
        self._reset_gathered()
        todo = [sp for sp in self._sps if sp.state is ParamState.PARTITIONED]
        if todo:
            self.gatherer.gather(todo, "all parameters (remove)", header_check=True)
        for sp in self._sps:
            sp.release_persistence()
            self.gatherer.count_live(sp, -1)  # no longer a gathered copy: an ordinary tensor now
            full = sp.data
            sp.forget()
            sp.data = full
        self._sps = []
        if self.swapper is not None:  # every parameter is an ordinary tensor again: the swap files can go
            self.swapper.close()

    # ------------------------------------------------------------------ iteration boundaries
    def _root_pre_forward(self, module, args):
        _refuse_functorch()
        if self.states.any_open():  # the root called from inside its own forward: not a new iteration
            return None
        self._reset_gathered()
        self.states.begin_iteration()
        if _external_version() != self._external_version:
            self._rebuild_after_external_change()
        self.trace.begin_iteration(torch.is_grad_enabled())
        self._miss_logged = False
        self.gatherer.header_checks = self.trace.recording
        return None

    def _root_post_forward(self, module, args, output):
        if torch.is_grad_enabled():
            # the first gradient of any backward through the root's outputs: the pass is in backward from here
            register_output_grad_hooks(output, self._on_root_output_grad, None)
        elif not self.states.any_open():
            self._drop_read_holds()
            self._release_unheld(park=True)
        return None

    def _on_root_output_grad(self, _call) -> None:
        self.states.begin_backward()

    def _rebuild_after_external_change(self) -> None:
        self._build_groups()
        self.trace = self._new_trace()
        self._sync_module_hooks()

    def _new_trace(self) -> GatherTrace:
        return GatherTrace({g.gid: g.numel for g in self._groups.values()},
                           on_miss=self._trace_miss if self._log_trace_misses else None)

    def _trace_miss(self, gid: int) -> None:
        if self._miss_logged:
            return
        self._miss_logged = True
        fqn = next((g.fqn for g in self._groups.values() if g.gid == gid), str(gid))
        logger.warning("hf_zero: ZeRO-3 prefetch trace: module %s asked for its parameters out of the order "
                       "recorded in the first iteration; prefetching resumes at the next module found in that order "
                       "(zero_optimization.log_trace_cache_warnings; logged once per iteration)", fqn)

    # ------------------------------------------------------------------ forward
    def _pre_forward(self, module, args, kwargs):
        group = self._groups[module]
        call = self.states.start_forward(module, group)
        self._acquire(group, HoldReason.FORWARD)
        if torch.is_grad_enabled():
            wrapped = wrap_inputs_for_post_backward(args, kwargs, self._post_backward, call)
            call.has_post_backward = wrapped is not None
            return wrapped
        return None

    def _post_forward(self, module, args, output):
        ended = self.states.end_forward(module)
        if ended is None:  # hooks of an iteration that was reset under us (e.g. an exception); nothing held
            return None
        call, recomputed = ended
        if recomputed:
            # Recomputation under activation checkpointing. Non-reentrant checkpointing saves *frozen* parameters
            # by reference (trainable ones as detached aliases) and compares their shapes with the original
            # forward's right after recomputing (transformers#47254): frozen ones stay whole until the next
            # backward event, which comes after that check.
            for sp in call.group.sps:
                if sp.requires_grad:
                    self._unhold(sp, HoldReason.FORWARD)
                elif sp.release(HoldReason.FORWARD):
                    self._deferred.add(sp)
        else:
            self._release_group(call.group, HoldReason.FORWARD, park=True)
        if torch.is_grad_enabled():
            register_output_grad_hooks(output, self._pre_backward, call)
        return None

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, call: ModuleCall) -> None:
        if not self.states.start_backward_of(call):
            return
        self._settle_recomputation()
        self._queue_end_of_backward()
        self._acquire(call.group, HoldReason.BACKWARD)
        for sp in call.group.sps:
            if sp.requires_grad and sp.ds_id not in self._awaiting_grad:
                # Keep it gathered until its AccumulateGrad ran: a gradient must never land on a (0,) placeholder.
                self._awaiting_grad.add(sp.ds_id)
                sp.acquire(HoldReason.GRAD_PENDING)
        if not call.has_post_backward:
            # No input needs a gradient (e.g. the embedding: token ids), so nothing marks the end of this module's
            # backward except its own parameters' gradients arriving: the last one ends it.
            call.grads_pending = {sp.ds_id for sp in call.group.sps if sp.requires_grad}
            for ds_id in call.grads_pending:
                self._calls_awaiting_grad.setdefault(ds_id, []).append(call)

    def _post_backward(self, call: ModuleCall) -> None:
        if not self.states.end_backward_of(call):
            return
        self._settle_recomputation()
        self._release_group(call.group, HoldReason.BACKWARD)

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        sp = sharded_param_of(param)
        if self.grad_guard is not None:
            self.grad_guard(sp.name)
        grad = sp.grad
        param.grad = None
        self.states.begin_backward()
        self._settle_recomputation()
        self._queue_end_of_backward()
        if grad is not None and self._held_grads is not None:
            held = self._held_grads.get(sp.ds_id)
            self._held_grads[sp.ds_id] = (sp, grad if held is None else held[1].add_(grad))
            del grad, held
        elif grad is not None and not (self.leaf_grads is not None and self.leaf_grads.hold(sp, grad)):
            self.reducer.add(sp, grad)  # held until reduced, then its bytes serve a later gather (reduce.py)
            del grad
        self._grad_accounted(sp)

    def _grad_accounted(self, sp: ShardedParam) -> None:
        """``sp``'s gradient for this backward is in (or, in a leaf it did not take part in, counted as zero):
        nothing keeps it gathered for it any more, and a call waiting for it may be over."""
        if sp.ds_id in self._awaiting_grad:
            self._awaiting_grad.discard(sp.ds_id)
            self._unhold(sp, HoldReason.GRAD_PENDING)
        for call in self._calls_awaiting_grad.pop(sp.ds_id, ()):
            call.grads_pending.discard(sp.ds_id)
            if not call.grads_pending:
                self._post_backward(call)

    def _queue_end_of_backward(self) -> None:
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        # NOTE: with reentrant activation checkpointing this may run at the end of an *inner* backward, so it
        # only does what is safe mid-backward: launch the filled bucket, free what nobody holds.
        self._end_of_backward_queued = False
        self._settle_recomputation()
        self.reducer.flush()
        self._drop_read_holds()
        self._release_unheld()

    def _drop_read_holds(self) -> None:
        holds, self._read_holds = self._read_holds, []
        for sp in holds:
            sp.release(HoldReason.READ)

    # ------------------------------------------------------------------ parameters read without calling their module
    def _on_param_read(self, param: nn.Parameter) -> None:
        """``module.weight`` read while partitioned. Inside a forward (``nn.MultiheadAttention`` reading
        ``out_proj.weight``, fused projections) it is gathered now and held as part of the innermost module in
        forward, for this forward and its backward; it is also registered as that module's external parameter, so
        from the next iteration on it is gathered with the module's group (DeepSpeed does the same)."""
        sp = sharded_param_of(param)
        innermost = self.states.innermost()
        if sp is None or sp.persistent or sp.state is ParamState.AVAILABLE or innermost is None:
            return
        if sp.persist_planned:  # read inside a forward before any publishing hook ran
            self._publish_persistent()
            return
        grouped = self.states.innermost_with_group()
        if grouped is not None:
            module, call = grouped
            group = call.group
            if sp not in group.sps:
                group.sps.append(sp)
                group.numel += sp.numel
                self._groups_of_sp.setdefault(sp.ds_id, set()).add(group.gid)
                sp.acquire(HoldReason.FORWARD)  # dropped by this call's release like the group's own parameters
        else:
            # only modules without a group of their own are in forward: hold it until this backward ends (the
            # next iteration gathers it with the module it is registered on below)
            module = innermost[0]
            sp.acquire(HoldReason.READ)
            self._read_holds.append(sp)
        _register_external(module, param)
        if sp.state is ParamState.PARTITIONED:
            self.gatherer.gather([sp], f"{sp.name} (read in the forward of {type(module).__name__})")
        self.gatherer.wait_available(sp)

    def annotate_forward_error(self, error: BaseException) -> None:
        """A forward failed: if the innermost module in forward has partitioned parameters it did not gather, say
        which module and what to do (they were used through a reference hf_zero cannot see)."""
        innermost = self.states.innermost()
        if innermost is None or not hasattr(error, "add_note"):
            return
        module, _ = innermost
        partitioned = [sp.name for p in module.parameters() if (sp := sharded_param_of(p)) is not None
                       and sp.state is ParamState.PARTITIONED]
        if partitioned:
            fqn = next((n for n, m in self.module.named_modules() if m is module), "?") or "<root>"
            shown = ", ".join(partitioned[:4]) + (" ..." if len(partitioned) > 4 else "")
            error.add_note(
                f"hf_zero ZeRO-3: this was raised in the forward of module {fqn!r} "
                f"({type(module).__name__}), whose sub-modules' parameters [{shown}] were still partitioned "
                f"(1-D placeholders). If {type(module).__name__} uses them without calling their modules, mark it "
                f"as a leaf: hf_zero.zero.set_z3_leaf_modules(model, [{type(module).__name__}]) "
                f"(deepspeed.utils.set_z3_leaf_modules), before or after initialize")

    # ------------------------------------------------------------------ gather / release policy
    def _acquire(self, group: _Group, reason: HoldReason) -> None:
        faults.settle_if_ready(self.group)  # a deferred prefetch whose header arrived leaves now, not when needed
        self.trace.request(group.gid)
        for sp in group.sps:
            sp.acquire(reason)
        need = [sp for sp in group.sps if sp.state is ParamState.PARTITIONED]
        need_numel = sum(sp.numel for sp in need)
        if need and self.gatherer.live_numel + need_numel > self.max_live_numel:
            self._release_unheld(park=not self.states.in_backward)
        if need:
            self.gatherer.gather(need, f"module {group.fqn!r}", async_op=True)
        self._prefetch()
        for sp in group.sps:
            self.gatherer.wait_available(sp)

    def _prefetch(self) -> None:
        if self.prefetch_numel <= 0:
            return
        by_gid = self._group_by_gid
        picked: list[ShardedParam] = []
        picked_ids: set[int] = set()
        budget = self.max_live_numel - self.gatherer.live_numel
        total = 0
        for gid in self.trace.upcoming(self.prefetch_numel):
            for sp in by_gid[gid].sps:
                if sp.state is ParamState.PARTITIONED and sp.ds_id not in picked_ids:
                    if total + sp.numel > budget:
                        break
                    picked.append(sp)
                    picked_ids.add(sp.ds_id)
                    total += sp.numel
        if picked:
            self.prefetched_numel += total
            names = sorted({by_gid[g].fqn for sp in picked for g in self._groups_of_sp[sp.ds_id]})
            self.gatherer.gather(picked, f"prefetch of modules {names}", async_op=True)
        if self.swapper is not None:
            # Swapped shards: start reading the groups after those (at least the next one) from the drive,
            # so their gathers find the data in memory. Only this rank's shards are read: 1/world of the bytes.
            window = self.trace.upcoming(2 * self.prefetch_numel, min_groups=1)
            self.swapper.read_ahead(sp.storage for gid in window for sp in by_gid[gid].sps
                                    if sp.state is ParamState.PARTITIONED)

    def _settle_recomputation(self) -> None:
        """At a backward event: the holds of recomputations stopped early (see TrainingStates.stop_recomputations)
        are released, as are the frozen params kept whole for checkpointing's shape check."""
        for call in self.states.stop_recomputations():
            self._release_group(call.group, HoldReason.FORWARD)
        if self._deferred:
            self._release_deferred()

    def _release_deferred(self) -> None:
        deferred, self._deferred = self._deferred, set()
        for sp in deferred:
            if sp.holders == 0 and not self._keep_for_reuse(sp):
                self.gatherer.release(sp)

    def _release_group(self, group: _Group, reason: HoldReason, *, park: bool = False) -> None:
        for sp in group.sps:
            self._unhold(sp, reason, park=park)

    def _unhold(self, sp: ShardedParam, reason: HoldReason, *, park: bool = False) -> None:
        """``park``: a release in the forward pass, see ShardedParam.to_partitioned."""
        if sp.release(reason) and not self._keep_for_reuse(sp):
            self.gatherer.release(sp, park=park)

    def _keep_for_reuse(self, sp: ShardedParam) -> bool:
        if self.gatherer.live_numel > self.max_live_numel:
            return False
        return self.trace.reused_within(self._groups_of_sp.get(sp.ds_id, set()), self.max_reuse_numel)

    def _release_unheld(self, *, park: bool = False) -> None:
        for sp in self._sps:
            if (sp.holders == 0 and not sp.persistent and sp.state is not ParamState.PARTITIONED
                    and sp not in self._deferred):
                self.gatherer.release(sp, park=park)

    def release_gathered(self) -> None:
        """``empty_partition_cache``: partition every gathered parameter, the persistent ones too (DeepSpeed's
        release-all: the memory goes back, e.g. before an inference engine loads); the next forward gathers the
        persistent ones again, as at start-up. One rank alone holding whole parameters as its shards frees
        nothing by partitioning, so keeps them."""
        self._reset_gathered()
        if self.whole:
            return
        persistent = self._partition_persistent()
        if persistent:
            self._unpublished = persistent + self._unpublished
            self._install_publish_hooks()

    def _partition_persistent(self) -> list[ShardedParam]:
        """Let every persistent parameter go back to its shard (no longer persistent); returns them, for the caller
        to gather again now (shards_changed) or at the next forward (release_gathered)."""
        persistent = [sp for sp in self._sps if sp.persistent]
        for sp in persistent:
            sp.release_persistence()
            sp.to_partitioned()
            self.gatherer.count_live(sp, -1)
        return persistent

    def _reset_gathered(self) -> None:
        """Between iterations: forget every hold (leaks from early-stopped recomputation, unused backward
        paths) and partition everything that is not persistent. Also where the GPU gathers' divergence trailers
        are checked (Gatherer.check_deferred: one host sync per forward and per backward, not per module)."""
        self.gatherer.check_deferred()
        self.states.clear()
        self._read_holds.clear()
        self._awaiting_grad.clear()
        self._calls_awaiting_grad.clear()
        if self.leaf_grads is not None:
            self.leaf_grads.clear()
        self._deferred = set()
        for sp in self._sps:
            if not sp.persistent:
                sp.drop_holds()
            sp.forget_parked()
        self._release_unheld()


def _mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _persistent_buffers(module: nn.Module):
    for prefix, mod in module.named_modules():
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                yield (f"{prefix}.{n}" if prefix else n), b


_EXTERNAL_VERSION = [0]


def _external_version() -> int:
    return _EXTERNAL_VERSION[0]


def bump_external_version() -> None:
    _EXTERNAL_VERSION[0] += 1


class WatchedParameters(dict):
    """A module's ``_parameters`` that reports reads of partitioned parameters (``module.weight`` goes through
    ``__getitem__``); iteration, ``state_dict`` and assignment are a plain dict's. Copies and pickles are plain
    dicts, so a deep-copied model carries no reference to the runtime."""

    __slots__ = ("_on_read",)

    def __init__(self, params: dict, on_read) -> None:
        super().__init__(params)
        self._on_read = on_read

    def __getitem__(self, key):
        param = dict.__getitem__(self, key)
        if torch.compiler.is_compiling():
            # a compiled graph reads parameters the hooks (run eagerly, outside the graph) have gathered
            return param
        status = param.__dict__.get("ds_status") if param is not None else None
        if status is not None and status is not _AVAILABLE:
            self._on_read(param)
        return param

    def __reduce__(self):
        return (dict, (dict(self),))


def _unwatch(root: nn.Module) -> None:
    for mod in root.modules():
        if type(mod._parameters) is WatchedParameters:
            mod._parameters = dict(mod._parameters)


def _register_external(module: nn.Module, param: nn.Parameter) -> None:
    params = module.__dict__.setdefault(EXTERNAL_PARAMS_ATTR, [])
    if not any(p is param for p in params):
        params.append(param)
        bump_external_version()


def _is_within(module: nn.Module, ancestor: nn.Module) -> bool:
    return any(m is module for m in ancestor.modules())
