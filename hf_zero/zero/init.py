"""``zero.Init``: modules constructed inside the context come out with their parameters already partitioned.

How, without patching tensor constructors: two public global hooks of ``torch.nn.modules.module``.

- ``register_module_parameter_registration_hook`` notes every ``(module, name)`` that gets a Parameter.
- ``register_module_module_registration_hook`` fires when a finished module is assigned to its parent
  (``self.q_proj = nn.Linear(...)``, ``ModuleList.append``). Its ``__init__`` -- including its own
  ``reset_parameters()`` -- is complete at that point, so its noted parameters are partitioned right then.
  Construction peaks at about one submodule's full parameters, not the model's.

Each parameter is cut from the group's rank 0's values (broadcast first, as DeepSpeed's zero.Init does): ranks seeded
differently, or an ``__init__`` that writes on rank 0 only, still build one model.

Parameters of the outermost module(s), which no parent adopts, are partitioned on ``__exit__``. A nested context
partitions, on its own exit, the modules first noted inside it whose ``__init__`` has returned (DeepSpeed partitions
each module as its ``__init__`` ends, so ``zero.Init(); zero.Init(); Linear()`` is partitioned when the inner block
closes); a module still being constructed (its ``__init__`` opened the inner block) waits for its parent or for
the outermost exit.

A parent's ``__init__`` that initialises its children with ``self.apply(fn)`` (nanoGPT's ``_init_weights``, timm)
runs after they were partitioned: ``fn`` would see 1-D placeholders and change nothing, silently. So, with
``zero_optimization.override_module_apply`` (true by default, as in DeepSpeed), every module built inside the
context gets an instance ``apply`` that gathers each module's own parameters around ``fn(module)`` (rank 0's result
kept, then re-partitioned: :func:`_apply_gathered`). Per instance, removed on ``__exit__``: ``nn.Module.apply`` itself
is never replaced, and modules built elsewhere are untouched.

With ``zero_optimization.offload_param.device: nvme`` in the config (or ``remote_device="nvme"``), each shard
is written to this rank's swap files under ``nvme_path`` right after it is cut, so a model larger than memory can
be built: the peak is one submodule's full parameters. The engine built with the same config finds them there.

This module is also ``deepspeed.runtime.zero.partition_parameters`` for transformers (through the shim): it defines
``zero_wrapper_for_fp_tensor_constructor``, ``_orig_torch_arange`` and ``get_accelerator``, which
``transformers.integrations.deepspeed.prevent_arange_dtype_change`` reads and temporarily replaces. hf_zero never
wraps tensor constructors -- parameters are cast as they are partitioned and buffers as they are registered (see
:class:`Init`) -- so the wrapper is looked up at ``__enter__`` (to honour the contract that it is read there) but
never installed.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from hf_zero.config.loader import read_config
from hf_zero.config.policies import InitPrecision, init_precision, param_offload_device, param_offload_policy

from .buffer_dtypes import CASTABLE_DTYPES, keep_buffers_in_fp32, keep_in_fp32_pattern
from .gathered import GatheredParameters  # deepspeed.runtime.zero.partition_parameters.GatheredParameters
from .stage3.gather import gatherer_for
from .stage3.param import (ParamState, ShardedParam, ZeroParamStatus, sharded_param_of,
                           values_from_group_rank0)

__all__ = ["Init", "zero_wrapper_for_fp_tensor_constructor", "get_accelerator", "partition_module", "GatheredParameters",
           "ZeroParamStatus", "unpartition_module"]

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: torch.device | str | None = None) -> Callable:
    """``fn`` with floating-point results cast to ``target_fp_dtype`` and ``device`` defaulted to
    ``target_device`` -- DeepSpeed's helper, kept for code that builds its own wrapped constructors."""

    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        t = fn(*args, **kwargs)
        if t.is_floating_point() and target_fp_dtype is not None:
            t = t.to(target_fp_dtype)
        return t

    return wrapped


def get_accelerator():
    from hf_zero.comm.accelerator import get_accelerator as _get

    return _get()


def _resolve_group(data_parallel_group, mpu, sequence_data_parallel_group):
    if sequence_data_parallel_group is not None:
        return sequence_data_parallel_group
    if data_parallel_group is not None:
        return data_parallel_group
    if mpu is not None:
        return mpu.get_data_parallel_group()
    return None


def _read_config(config_dict_or_path, config) -> dict | None:
    """The raw config dict, or None when neither argument was given."""
    cfg = config_dict_or_path if config_dict_or_path is not None else config
    if cfg is None:
        return None
    if isinstance(cfg, (str, os.PathLike, dict)):
        return read_config(cfg)
    return dict(getattr(cfg, "config", {}) or {})  # transformers' HfDeepSpeedConfig and similar wrappers


def partition_module(module: nn.Module, *, group=None, dtype: torch.dtype | None = None,
                     pin_memory: bool = False, swapper=None, device: torch.device | None = None) -> list[ShardedParam]:
    """Partition every not-yet-partitioned parameter of ``module`` (recursively). Call on every rank.
    ``swapper`` (a :class:`~hf_zero.offload.param_swap.ParamSwapper`): write each shard to swap files.
    ``device``: where the shards live (None: where each parameter is)."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    gatherer_for(group)  # its side channel is created collectively, so at the same point on every rank
    out = []
    for prefix, mod in module.named_modules():
        for name in list(mod._parameters):
            sp = _partition_one(mod, name, prefix, rank, world, group, dtype, pin_memory, swapper, device)
            if sp is not None:
                out.append(sp)
    return out


def unpartition_module(module: nn.Module) -> int:
    """The inverse of :func:`partition_module`: every partitioned parameter of ``module`` gets its whole values back
    as an ordinary tensor, module by module (a gather over each parameter's group: call on every rank). Returns how
    many parameters were given back.

    Tensor parallelism cuts whole weights: a model built under :class:`Init` is made whole before ``apply_tp``
    shards it, and the engine's ZeRO-3 then partitions each rank's TP shard over the data-parallel group. The
    peak is the whole model on every rank, as for a TP model built without zero.Init."""
    count = 0
    for prefix, mod in module.named_modules():
        sps = [sp for p in mod._parameters.values() if p is not None and (sp := sharded_param_of(p)) is not None]
        if not sps:
            continue
        gatherer = gatherer_for(sps[0].group)
        for sp in sps:
            gatherer.wait_available(sp)
        need = [sp for sp in sps if sp.state is ParamState.PARTITIONED]
        if need:
            gatherer.gather(need, f"the whole weights of module {prefix or '<root>'!r}", header_check=True)
        for sp in sps:
            full = sp.data.clone()  # its own storage: the gathered buffer is the gatherer's to reuse
            sp.release_persistence()
            gatherer.release(sp)
            sp.forget()
            sp.data = full
            count += 1
    return count


def _partition_one(mod: nn.Module, name: str, prefix: str, rank: int, world: int, group, dtype,
                   pin_memory: bool, swapper=None, device: torch.device | None = None) -> ShardedParam | None:
    p = mod._parameters.get(name)
    if p is None or sharded_param_of(p) is not None:
        return None
    if not p.is_floating_point():  # a quantized (uint8/int8) weight keeps its packed dtype
        dtype = None
    if world > 1:
        from hf_zero.comm.device import local_device

        # NCCL takes accelerator tensors; gloo on the CPU takes them where they are
        values = values_from_group_rank0(p, group, device=local_device())
        if values is not p.data:
            p.data = values
    label = f"{prefix}.{name}" if prefix else f"{type(mod).__name__}.{name}"
    sp = ShardedParam(p, label, rank=rank, world_size=world, group=group, dtype=dtype,
                      device=None if swapper is not None else device)
    if swapper is not None:
        sp.to_swapped(swapper)
    elif pin_memory and torch.cuda.is_available() and sp.local_shard.device.type == "cpu":
        sp.use_shard_storage(torch.empty_like(sp.local_shard).pin_memory())
    return sp


def shard_device(raw: dict, remote_device) -> torch.device:
    """Where zero.Init puts the shards it cuts, as DeepSpeed does: the device this process trains on (its GPU),
    unless parameters are offloaded -- ``remote_device`` "cpu" (or, unset, ``offload_param.device`` "cpu") keeps
    them in host memory, "nvme" sends them to swap files (read into host memory for each gather)."""
    from hf_zero.comm.device import local_device

    if param_offload_device(raw, remote_device) in ("cpu", "nvme"):
        return torch.device("cpu")
    return local_device()


def _param_swapper(raw: dict, remote_device, rank: int):
    """The ParamSwapper zero.Init swaps shards into, or None (see :func:`hf_zero.config.param_offload_policy`)."""
    from hf_zero.offload.param_swap import param_swapper_for

    policy = param_offload_policy(raw, remote_device)
    if policy is None:
        return None
    return param_swapper_for(policy.nvme_path, rank=rank, aio=policy.aio)


def _init_precision(raw: dict | None, dtype: torch.dtype | None) -> InitPrecision:
    """The dtype zero.Init builds in (see :class:`Init`): ``dtype``, else the config's precision mode, else fp32 when
    a config was given, else None (as built)."""
    if raw is None:
        return InitPrecision(dtype=dtype)
    precision = init_precision(raw)
    return InitPrecision(dtype=dtype or precision.dtype or torch.float32, keep_in_fp32=precision.keep_in_fp32)


def _modules_under_construction() -> set[int]:
    """ids of the objects whose ``__init__`` is on the call stack now (a module built in a nested zero.Init may
    still be running its own ``__init__`` when the nested block closes)."""
    out = set()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and "self" in frame.f_code.co_varnames[:1]:
            out.add(id(frame.f_locals["self"]))
        frame = frame.f_back
    return out


def _apply_gathered(module: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """``module.apply(fn)`` for a module built under :class:`Init`: children first (their own ``apply``, gathering
    too where they were built inside), then ``fn(module)`` with the module's own partitioned parameters gathered;
    rank 0's values are kept on every rank (``modifier_rank=0``, as DeepSpeed's override) and re-partitioned."""
    for child in module.children():
        child.apply(fn)
    params = [p for p in module._parameters.values() if p is not None and sharded_param_of(p) is not None]
    if not params:
        fn(module)
        return module
    with GatheredParameters(params, modifier_rank=0):
        fn(module)
    return module


class Init:
    """Context manager: modules built inside get their parameters partitioned as they are constructed.

    Same signature as ``deepspeed.zero.Init``. Accepted for compatibility and without effect here:
    ``mem_efficient_linear`` (hf_zero's linear layers are torch's), ``param_swapper``. ``config_dict_or_path`` /
    ``config`` is read for ``zero_optimization.offload_param``, ``aio``, ``bf16``/``fp16`` and
    ``data_types.keep_in_fp32_modules`` (the engine reads the rest).
    ``remote_device`` may be None (the config's offload_param device), "none" (shards on the device this process
    trains on: its GPU, as in DeepSpeed), "cpu" (shards in host memory) or "nvme" (shards go to
    ``offload_param.nvme_path``); see :func:`shard_device`.
    ``module=``: partition an already built module immediately (no context needed).

    Dtypes, as DeepSpeed 0.19.8 (measured on 2 CPU ranks, docs/zero_memory.md): the training dtype is ``dtype``
    when given, else bfloat16 / float16 when the config enables ``bf16`` / ``fp16``, else float32 when a config is
    given. Floating parameters are partitioned in it -- ``param.dtype``, ``param.ds_tensor.dtype`` and the gathered
    parameter all show it -- and floating buffers registered inside the context are cast to it as they are
    registered (DeepSpeed's wrapped tensor constructors do the same to every floating tensor built inside), except
    the ones ``data_types.keep_in_fp32_modules`` names (by default the model's transformers lists), which are fp32
    again once their module is built. The fp32 values are not kept: the engine's fp32 master weights start from the
    16-bit shards, as DeepSpeed's do (``_create_fp32_partitions`` upcasts the 16-bit partitions). Keeping them would
    cost 4 bytes per parameter per data-parallel rank from here to the first step, on the device the shards live on
    (its GPU) and at the point the model is largest, for a gain only in a model trained from its random
    initialisation: a checkpoint loaded afterwards (``from_pretrained``) is copied into the 16-bit gathered
    parameters, and those are what the shards and the masters then hold either way.
    Without any config and ``dtype``, parameters keep the dtype they were built in (DeepSpeed picks float16 there
    whenever the accelerator supports it; hf_zero does not guess a precision no config asked for).
    """

    _depth = 0  # nested Init contexts install the hooks once
    _active: "Init | None" = None  # the outermost open context: its hooks note what every nested one builds

    def __init__(self, config_dict_or_path=None, enabled: bool = True, dtype: torch.dtype | None = None,
                 module: nn.Module | None = None, mem_efficient_linear: bool = True, remote_device=None,
                 pin_memory: bool = False, config=None, mpu=None, data_parallel_group=None, param_swapper=None,
                 sequence_data_parallel_group=None) -> None:
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected None, 'none', 'cpu' or 'nvme' "
                             f"(shards stay where they are built, or go to offload_param.nvme_path)")
        self.enabled = enabled
        self.pin_memory = pin_memory
        raw = _read_config(config_dict_or_path, config)
        self.config = raw if raw is not None else {}
        self._precision = _init_precision(raw, dtype)
        self.dtype = self._precision.dtype
        self.group = _resolve_group(data_parallel_group, mpu, sequence_data_parallel_group)
        self._remote_device = remote_device
        self.swapper = None  # set when enabled, once the rank is known (see _param_swapper)
        self._pending: dict[int, tuple[nn.Module, set[str]]] = {}
        self._on_meta: dict[int, tuple[nn.Module, set[str]]] = {}  # noted parameters still on the meta device
        self._handles: list = []
        self._owner = False
        self._noted_before: set[int] = set()  # nested: the modules the outermost context had noted at __enter__
        self._roots: dict[int, nn.Module] = {}  # modules no parent has adopted (yet): the model's root at __exit__
        # zero_optimization.override_module_apply (DeepSpeed's default true): see the module docstring
        self._override_apply = bool((self.config.get("zero_optimization") or {}).get("override_module_apply", True))
        self._applies: dict[int, nn.Module] = {}  # modules given a gathering apply, undone at __exit__
        if module is not None and enabled:
            self._ensure_distributed()
            self.swapper = _param_swapper(self.config, remote_device, dist.get_rank())
            partition_module(module, group=self.group, dtype=self.dtype, pin_memory=pin_memory,
                             swapper=self.swapper, device=shard_device(self.config, remote_device))
            self._keep_in_fp32(module)  # buffers of a module built outside are not cast; a listed one is upcast

    @staticmethod
    def _ensure_distributed() -> None:
        if not dist.is_initialized():
            from hf_zero.comm import init_distributed

            init_distributed()

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._ensure_distributed()
        self._rank = dist.get_rank(self.group)
        self._world = dist.get_world_size(self.group)
        self.swapper = _param_swapper(self.config, self._remote_device, dist.get_rank())
        self._device = shard_device(self.config, self._remote_device)
        gatherer_for(self.group)
        from hf_zero.comm.device import accelerator_type

        if accelerator_type() == "cpu":  # CPU training: host memory is the training memory (comm/host_memory.py)
            from hf_zero.zero.host_memory import tune_cpu_training_memory

            tune_cpu_training_memory(stage3=True)
        # Looked up at enter time, as transformers expects (it may have swapped it in); see the module docstring
        # for why it is not installed anywhere.
        self._fp_constructor_wrapper = globals()["zero_wrapper_for_fp_tensor_constructor"]
        if Init._depth == 0:
            Init._active = self
            self._owner = True
            self._roots = {}
            self._handles = [register_module_parameter_registration_hook(self._on_parameter),
                             register_module_module_registration_hook(self._on_submodule)]
            if self.dtype is not None:
                self._handles.append(register_module_buffer_registration_hook(self._on_buffer))
        else:  # nested: the outermost context's hooks note what is built; this exit partitions what it noted
            self._noted_before = set(Init._active._pending)
        Init._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        Init._depth -= 1
        if not self._owner and Init._active is not None:
            owner = Init._active
            building = _modules_under_construction()
            for key in [k for k in owner._pending if k not in self._noted_before and k not in building]:
                owner._partition_noted(*owner._pending.pop(key))
        if self._owner:
            Init._active = None
            for h in self._handles:
                h.remove()
            self._handles = []
            pending, self._pending = self._pending, {}
            for mod, names in pending.values():
                self._partition_noted(mod, names)
            on_meta, self._on_meta = self._on_meta, {}
            for mod, names in on_meta.values():  # materialized since their adoption, or still meta: left as built
                self._on_meta[id(mod)] = (mod, names)
                self._partition_materialized(mod)
            self._on_meta = {}
            roots, self._roots = self._roots, {}
            for mod in roots.values():  # the outermost modules, which no parent adopted: the model itself
                self._keep_in_fp32(mod)
            applies, self._applies = self._applies, {}
            for mod in applies.values():
                mod.__dict__.pop("apply", None)

    # ------------------------------------------------------------------ hooks
    def _on_parameter(self, module: nn.Module, name: str, param) -> None:
        if param is not None and sharded_param_of(param) is None:
            self._pending.setdefault(id(module), (module, set()))[1].add(name)
            self._roots.setdefault(id(module), module)
            self._gathering_apply(module)
        return None

    def _gathering_apply(self, module: nn.Module) -> None:
        if self._override_apply and id(module) not in self._applies:
            self._applies[id(module)] = module
            # an instance attribute shadows nn.Module.apply for this module only (plain object attribute: not a
            # Parameter, buffer or Module, so nn.Module.__setattr__'s bookkeeping is not involved)
            module.__dict__["apply"] = functools.partial(_apply_gathered, module)

    def _on_buffer(self, module: nn.Module, name: str, buffer):
        """A floating buffer registered inside the context becomes the training dtype (see the class docstring)."""
        self._roots.setdefault(id(module), module)
        if buffer is not None and buffer.dtype in CASTABLE_DTYPES and buffer.dtype != self.dtype:
            return buffer.to(self.dtype)
        return None

    def _on_submodule(self, parent: nn.Module, name: str, child) -> None:
        if child is None:
            return None
        # The child's __init__ is done. Its descendants were partitioned when they were adopted by it (or by
        # their own parents); only the child's direct parameters can still be pending.
        entry = self._pending.pop(id(child), None)
        if entry is not None:
            self._partition_noted(*entry)
        if self._on_meta:
            self._partition_materialized(child)
        self._roots.pop(id(child), None)
        self._roots.setdefault(id(parent), parent)
        self._gathering_apply(parent)
        self._keep_in_fp32(child)  # DeepSpeed applies the model's fp32 lists as each module's __init__ ends
        return None

    def _keep_in_fp32(self, module: nn.Module) -> None:
        if self.dtype in (torch.float16, torch.bfloat16):
            keep_buffers_in_fp32(module, keep_in_fp32_pattern(module, self._precision.keep_in_fp32, self.dtype))

    def _partition_noted(self, mod: nn.Module, names: set[str]) -> None:
        # Registration order, never set order: ds_ids must be assigned identically on every rank.
        meta = set()
        for name in [n for n in mod._parameters if n in names]:
            p = mod._parameters[name]
            if p is not None and p.is_meta:
                meta.add(name)  # no values to cut yet (see _partition_materialized)
                continue
            _partition_one(mod, name, "", self._rank, self._world, self.group, self.dtype, self.pin_memory,
                           self.swapper, self._device)
        if meta:
            self._on_meta[id(mod)] = (mod, meta)

    def _partition_materialized(self, root: nn.Module) -> None:
        """Parameters built on the meta device (``torch.nn.utils.skip_init``: a module built with device="meta",
        then ``to_empty()``) have no values to cut when their module is adopted; they are cut once the module
        under ``root`` holding them has real storage -- by the adoption of ``root``, or at the context's exit."""
        for m in root.modules():
            entry = self._on_meta.get(id(m))
            if entry is not None and not any(p is not None and p.is_meta for n, p in m._parameters.items()
                                             if n in entry[1]):
                self._partition_noted(*self._on_meta.pop(id(m)))
