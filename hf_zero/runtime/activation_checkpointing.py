"""DeepSpeed's activation-checkpointing API (``deepspeed.checkpointing``), as Megatron-DeepSpeed scripts call it.

    checkpointing.configure(mpu, deepspeed_config="ds_config.json")   # reads "activation_checkpointing"
    checkpointing.model_parallel_cuda_manual_seed(1234)
    hidden = checkpointing.checkpoint(layer, hidden, mask)             # keeps only the inputs; recomputes in backward

A checkpointed region keeps its inputs, not its activations, and runs again during backward. The recomputation
sees what the first run saw -- CPU and device generator states, the RNG tracker's streams
(:mod:`hf_zero.runtime.rng_tracker`) and the autocast state -- so dropout masks and dtypes, hence gradients, equal
a run without checkpointing. (DeepSpeed 0.19.8 does not restore autocast: its recomputation runs in fp32.)

Options (``configure`` arguments override the config section, as in DeepSpeed):

- ``cpu_checkpointing`` / ``checkpoint_in_cpu``: the inputs are kept as copies in CPU memory and copied back to
  their device for the recomputation. The device input itself is freed when the caller drops it (DeepSpeed empties
  it in place, even while the caller still holds it).
- ``partition_activations``: each rank of the mpu's model-parallel group keeps 1/size of every floating input
  (they are replicated across that group in Megatron) and the recomputation all-gathers them.
- ``synchronize_checkpoint_boundary``: the device is synchronised when a region's forward and backward start and
  end (CUDA; the CPU has nothing to wait for).
- ``profile``: each region's forward and backward is timed and logged on rank 0 as DeepSpeed does,
  ``time (ms) | fwd: 0.07`` / ``time (ms) | backward: 0.34``.
- ``contiguous_memory_optimization`` (with ``number_checkpoints``): DeepSpeed copies partitions into one
  preallocated buffer per input to limit fragmentation. Not applied: partitions are separate tensors (same values);
  setting it warns once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.comm import get_rank
from hf_zero.comm import all_gather_packed
from hf_zero.comm.accelerator import get_accelerator
from hf_zero.config import ActivationCheckpointingConfig, ConfigError, read_config
from hf_zero.config.schema import parse
from hf_zero.config.status import ConfigKeyIgnored

from . import rng_tracker
from .rng_tracker import CudaRNGStatesTracker, get_cuda_rng_tracker

__all__ = ["CheckpointingOptions", "CheckpointFunction", "CudaRNGStatesTracker", "checkpoint", "configure",
           "current_options", "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
           "model_parallel_reconfigure_tp_seed", "non_reentrant_checkpoint", "partition_activations_in_checkpoint",
           "reset", "set_num_layers"]

logger = logging.getLogger("hf_zero")

_SECTION = "activation_checkpointing"


@dataclass(frozen=True, kw_only=True)
class CheckpointingOptions:
    """What ``configure`` settled on; field names are the config section's keys."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class _ModelParallel:
    """The mpu's (tensor) model-parallel group, over which ``partition_activations`` splits inputs."""

    rank: int = 0
    size: int = 1
    group: Any = None


class _Checkpointing:
    """The process's one configuration (DeepSpeed keeps it in module globals; scripts configure it once)."""

    def __init__(self) -> None:
        self.options = CheckpointingOptions()
        self.mpu: Any = None
        self.model_parallel = _ModelParallel()
        self.configured = False


_STATE = _Checkpointing()


# ---- configuration -------------------------------------------------------------------------------------------------

def configure(mpu_: Any, deepspeed_config: Mapping[str, Any] | str | os.PathLike | None = None,
              partition_activations: bool | None = None, contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None, checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None, profile: bool | None = None) -> None:
    """Set the options every later :func:`checkpoint` uses (DeepSpeed's signature).

    Starts from the defaults, then the ``activation_checkpointing`` section of ``deepspeed_config`` (a dict, a JSON
    file or base64 JSON; only that section is read, strictly: a misspelt key is an error), then every argument that
    is not None. ``mpu_`` (Megatron's parallel-state object) replaces the one given before when not None.
    """
    section = (ActivationCheckpointingConfig() if deepspeed_config is None
               else parse(ActivationCheckpointingConfig, read_config(deepspeed_config).get(_SECTION), _SECTION))
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    options = CheckpointingOptions(**{key: getattr(section, key) for key in given})
    options = dataclasses.replace(options, **{key: value for key, value in given.items() if value is not None})
    _check(options)
    if mpu_ is not None:
        _STATE.mpu = mpu_
    _STATE.options = options
    _STATE.model_parallel = _model_parallel(_STATE.mpu)
    _STATE.configured = True
    if get_rank() == 0:
        logger.info("Activation checkpointing: partition_activations=%s (over %d model-parallel ranks), "
                    "cpu_checkpointing=%s, contiguous_memory_optimization=%s (number_checkpoints=%s), "
                    "synchronize_checkpoint_boundary=%s, profile=%s", options.partition_activations,
                    _STATE.model_parallel.size, options.cpu_checkpointing, options.contiguous_memory_optimization,
                    options.number_checkpoints, options.synchronize_checkpoint_boundary, options.profile)


def _check(options: CheckpointingOptions) -> None:
    if not options.contiguous_memory_optimization:
        return
    key = f"{_SECTION}.contiguous_memory_optimization"
    if not options.partition_activations:
        raise ConfigError(key, "true needs partition_activations (DeepSpeed's rule); set "
                               f"{_SECTION}.partition_activations: true, or remove contiguous_memory_optimization")
    if options.number_checkpoints is None:
        raise ConfigError(key, f"true needs {_SECTION}.number_checkpoints (the number of checkpointed layers)")
    _warn_contiguous_not_applied()


_warned: set[str] = set()


def _warn_contiguous_not_applied() -> None:
    if "contiguous" in _warned:
        return
    _warned.add("contiguous")
    warnings.warn(f"{_SECTION}.contiguous_memory_optimization is not applied: hf_zero keeps each checkpoint "
                  "partition as its own tensor instead of copying it into one preallocated buffer (same values; only "
                  "the allocator's fragmentation differs)", ConfigKeyIgnored, stacklevel=3)


def _model_parallel(mpu: Any) -> _ModelParallel:
    if mpu is None:
        return _ModelParallel()
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return _ModelParallel(mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                              mpu.get_tensor_model_parallel_group())
    return _ModelParallel(mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
                          mpu.get_model_parallel_group())


def is_configured() -> bool:
    """True once :func:`configure` has been called."""
    return _STATE.configured


def current_options() -> CheckpointingOptions:
    """The options checkpointed regions use now (hf_zero's; DeepSpeed keeps them in module globals)."""
    return _STATE.options


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here (called between evaluation forwards). hf_zero keeps no
    buffers across regions -- each region's saved inputs die with its graph -- so there is nothing to free."""


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    _STATE.options = dataclasses.replace(_STATE.options, partition_activations=bool(partition_activation))


def set_num_layers(nlayers: int | None) -> None:
    _STATE.options = dataclasses.replace(_STATE.options, number_checkpoints=nlayers)


def _tp_rank(mpu: Any) -> int:
    """The tensor-parallel rank, asked the ways successive Megatron versions answer it."""
    for getter in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, getter):
            return int(getattr(mpu, getter)())
    return 0


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator and the tracker's model-parallel stream for this rank of the configured mpu
    (see :func:`hf_zero.runtime.rng_tracker.model_parallel_cuda_manual_seed`)."""
    mpu = _STATE.mpu
    tp_rank = _tp_rank(mpu) if mpu is not None else 0
    dp_rank = int(mpu.get_data_parallel_rank()) if hasattr(mpu, "get_data_parallel_rank") else get_rank()
    rng_tracker.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, dp_rank=dp_rank, global_rank=get_rank())


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    mpu = _STATE.mpu
    rng_tracker.model_parallel_reconfigure_tp_seed(seed, tp_rank=_tp_rank(mpu) if mpu is not None else 0)


# ---- what a region keeps between its forward and its recomputation ------------------------------------------------

def _is_activation(value: Any) -> bool:
    """Inputs the options act on: floating tensors (Megatron marks some ``no_checkpointing`` to keep them whole)."""
    return torch.is_tensor(value) and value.is_floating_point() and not getattr(value, "no_checkpointing", False)


@dataclass(frozen=True)
class _Slot:
    """How one positional input is kept: ``kind`` "object" (``value`` itself), "tensor" (saved as is), "cpu" (a copy
    in CPU memory) or "part" (this rank's 1/size of the flattened tensor); ``index`` into the saved tensors."""

    kind: str
    index: int = -1
    value: Any = None
    device: torch.device | None = None
    shape: torch.Size | None = None
    requires_grad: bool = False


def _stash(args: tuple, options: CheckpointingOptions, mp: _ModelParallel) -> tuple[list[torch.Tensor], list[_Slot]]:
    """The tensors to save for ``args`` and how to rebuild each argument from them."""
    tensors: list[torch.Tensor] = []
    slots: list[_Slot] = []
    for arg in args:
        if not torch.is_tensor(arg):
            slots.append(_Slot("object", value=arg))
            continue
        kept = arg.detach()
        kind = "tensor"
        if _is_activation(arg) and options.partition_activations and mp.size > 1:
            if kept.numel() % mp.size == 0:
                numel = kept.numel() // mp.size  # this rank's piece of the flattened input
                piece = kept.reshape(-1).narrow(0, mp.rank * numel, numel)
                kept, kind = (piece.to("cpu", copy=True) if options.cpu_checkpointing else piece.clone()), "part"
            else:
                _warn_not_partitioned(kept.shape, mp.size)
        if kind == "tensor" and _is_activation(arg) and options.cpu_checkpointing:
            kept, kind = kept.to("cpu"), "cpu"
        slots.append(_Slot(kind, len(tensors), device=arg.device, shape=arg.shape, requires_grad=arg.requires_grad))
        tensors.append(kept)
    return tensors, slots


def _warn_not_partitioned(shape: torch.Size, size: int) -> None:
    key = f"not-partitioned:{tuple(shape)}:{size}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{_SECTION}.partition_activations: a checkpoint input of shape {tuple(shape)} "
                      f"({shape.numel()} elements) does not split into {size} equal parts; it is kept whole",
                      stacklevel=4)


def _unstash(tensors: tuple[torch.Tensor, ...], slots: list[_Slot], mp: _ModelParallel) -> list[Any]:
    """The inputs again, on their devices, detached, each ``requires_grad`` as it was."""
    out: list[Any] = []
    for slot in slots:
        if slot.kind == "object":
            out.append(slot.value)
            continue
        kept = tensors[slot.index]
        if slot.kind == "part":
            piece = kept.to(slot.device)
            full = torch.empty(mp.size, piece.numel(), dtype=piece.dtype, device=slot.device)
            # bounded and checked like every hf_zero collective: a rank that died or skipped this recomputation
            # ends the job with its name instead of a hang
            all_gather_packed(full, piece.reshape(-1), group=mp.group,
                              what=f"the partition_activations gather of a checkpoint input {tuple(slot.shape)}")
            kept = full.view(slot.shape)
        elif slot.kind == "cpu":
            kept = kept.to(slot.device)
        kept = kept.detach()
        kept.requires_grad_(slot.requires_grad)
        out.append(kept)
    return out


# ---- what a recomputation must see again ---------------------------------------------------------------------------

def _device_rng_in_use() -> bool:
    return get_accelerator().device_name() == "cuda" and torch.cuda.is_initialized()


@dataclass(frozen=True)
class _RandomState:
    cpu: torch.Tensor
    device: torch.Tensor | None  # the current CUDA device's generator; None on CPU (the CPU state covers it)
    tracker: dict[str, torch.Tensor]

    @classmethod
    def now(cls) -> "_RandomState":
        device = get_accelerator().get_rng_state() if _device_rng_in_use() else None
        return cls(torch.get_rng_state(), device, get_cuda_rng_tracker().get_states())

    def install(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            get_accelerator().set_rng_state(self.device)
        # A copy: forks during the recomputation advance the installed dict, and a second backward over a retained
        # graph must start from the same states again.
        get_cuda_rng_tracker().set_states(dict(self.tracker))


def _autocast_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@dataclass(frozen=True)
class _AutocastState:
    per_device: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def now(cls) -> "_AutocastState":
        return cls(tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _autocast_devices()),
                   torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.per_device:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.cache_enabled))
            yield


@contextlib.contextmanager
def _replaying(random_state: _RandomState, autocast: _AutocastState) -> Iterator[None]:
    """Inside: the generators and autocast as the first run had them. After: the generators as they were."""
    now = _RandomState.now()
    random_state.install()
    try:
        with autocast.entered(), torch.enable_grad():
            yield
    finally:
        now.install()


# ---- synchronize_checkpoint_boundary and profile ------------------------------------------------------------------

class _Boundary:
    """Start and end of one region's forward or backward: device synchronisation and timing, as configured."""

    def __init__(self, name: str, options: CheckpointingOptions):
        self.name = name
        self.synchronize = options.synchronize_checkpoint_boundary
        self.profile = options.profile
        self.start_s = 0.0

    def enter(self) -> None:
        if self.synchronize or self.profile:  # profile: time the device's work, not the launch of it
            get_accelerator().synchronize()
        self.start_s = time.perf_counter()

    def exit(self) -> None:
        if self.synchronize or self.profile:
            get_accelerator().synchronize()
        if self.profile and get_rank() == 0:
            logger.info("time (ms) | %s: %.2f", self.name, 1000 * (time.perf_counter() - self.start_s))

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        self.enter()
        yield
        self.exit()


# ---- the reentrant region (DeepSpeed's checkpoint) -----------------------------------------------------------------

def _split_outputs(outputs: Any) -> tuple[list[Any], tuple[torch.Tensor, ...]]:
    """(every output in order, the tensor ones) for a tensor or a tuple/list of outputs."""
    everything = [outputs] if torch.is_tensor(outputs) else list(outputs)
    return everything, tuple(o for o in everything if torch.is_tensor(o))


class CheckpointFunction(torch.autograd.Function):
    """DeepSpeed's reentrant region: ``CheckpointFunction.apply(run_function, all_outputs, *args)`` runs
    ``run_function(*args)`` without building a graph, appends its outputs (tensors and others) to the list
    ``all_outputs`` and returns the tensor outputs; backward recomputes the region and backpropagates through it."""

    @staticmethod
    def forward(ctx, run_function: Callable, all_outputs: list, *args: Any):
        options, mp = _STATE.options, _STATE.model_parallel
        boundary = _Boundary("fwd", options)
        with boundary.around():
            ctx.run_function, ctx.options, ctx.model_parallel = run_function, options, mp
            ctx.random_state, ctx.autocast = _RandomState.now(), _AutocastState.now()
            tensors, ctx.slots = _stash(args, options, mp)
            ctx.save_for_backward(*tensors)
            outputs = run_function(*args)  # grad mode is off inside Function.forward: no graph is kept
        everything, tensor_outputs = _split_outputs(outputs)
        ctx.mark_non_differentiable(*(o for o in tensor_outputs if not o.is_floating_point()))
        all_outputs += everything
        return tensor_outputs[0] if torch.is_tensor(outputs) else tensor_outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("deepspeed.checkpointing.checkpoint does not work with torch.autograd.grad(); call "
                               ".backward() instead, or use non_reentrant_checkpoint")
        boundary = _Boundary("backward", ctx.options)
        with boundary.around():
            inputs = _unstash(ctx.saved_tensors, ctx.slots, ctx.model_parallel)
            with _replaying(ctx.random_state, ctx.autocast):
                _, outputs = _split_outputs(ctx.run_function(*inputs))
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            ctx.run_function = None  # the closure may hold large tensors; the graph node outlives this call
        return (None, None) + tuple(i.grad if torch.is_tensor(i) else None for i in inputs)


def _with_kwargs(function: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """Keyword arguments become trailing positional ones, so their tensors are kept and differentiated too."""
    if not kwargs:
        return function, args
    keys, count = tuple(kwargs), len(args)

    def call(*all_args):
        return function(*all_args[:count], **dict(zip(keys, all_args[count:])))

    return call, args + tuple(kwargs.values())


def _result(everything: list[Any]) -> Any:
    return everything[0] if len(everything) == 1 else tuple(everything)


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs (as configured) and recomputing it in backward.

    Returns what ``function`` returns (a one-element tuple comes back as its element, as in DeepSpeed).
    """
    function, args = _with_kwargs(function, args, kwargs)
    if not torch.is_grad_enabled():  # no backward will come: nothing to keep
        with _Boundary("fwd", _STATE.options).around():
            outputs = function(*args)
        return _result(_split_outputs(outputs)[0])
    everything: list[Any] = []
    returned = CheckpointFunction.apply(function, everything, *args)
    returned = (returned,) if torch.is_tensor(returned) else returned
    # The tensors autograd returned (attached to the region's graph node) in the places of function's tensors.
    attached = iter(returned)
    return _result([next(attached) if torch.is_tensor(o) else o for o in everything])


# ---- the non-reentrant region (saved-tensor hooks) -----------------------------------------------------------------

class _Holder:
    """Stands in, in the graph, for one tensor the first run saved; the recomputation supplies the tensor."""


def non_reentrant_checkpoint(function: Callable, *args: Any) -> Any:
    """Like :func:`checkpoint`, but the region is part of the caller's graph: it works when no input requires grad
    (the first pipeline stage) and with ``torch.autograd.grad``. The tensors the region's operations save are
    replaced by placeholders; the first one backward needs triggers one recomputation that supplies them all."""
    options, mp = _STATE.options, _STATE.model_parallel
    if not torch.is_grad_enabled():
        with _Boundary("fwd", options).around():
            return _result(_split_outputs(function(*args))[0])
    forward_boundary, backward_boundary = _Boundary("fwd", options), _Boundary("backward", options)
    forward_boundary.enter()
    random_state, autocast = _RandomState.now(), _AutocastState.now()
    placeholders: list[weakref.ref] = []  # in the order the first run saved them
    recomputed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    leaves: dict[int, torch.Tensor] = {}  # parameters and inputs the region saved: backward ends when all have grads
    kept: dict[str, Any] = {}

    def pack(tensor: torch.Tensor) -> _Holder:
        holder = _Holder()
        placeholders.append(weakref.ref(holder))
        if tensor.requires_grad and tensor.is_leaf:
            leaves[id(tensor)] = tensor
        return holder

    def recompute() -> None:
        backward_boundary.enter()
        inputs = _unstash(kept.pop("tensors"), kept.pop("slots"), mp)
        count = 0

        def replay_pack(tensor: torch.Tensor) -> None:
            nonlocal count
            if count == len(placeholders):
                raise RuntimeError("non_reentrant_checkpoint: the recomputation saved more tensors than the first run "
                                   "(the region must run the same operations both times)")
            holder = placeholders[count]()
            count += 1
            if holder is not None:  # the graph still holds this placeholder
                recomputed[holder] = tensor.detach()

        def replay_unpack(_: None) -> torch.Tensor:
            raise RuntimeError("non_reentrant_checkpoint: the recomputation itself was differentiated")

        with _replaying(random_state, autocast), torch.autograd.graph.saved_tensors_hooks(replay_pack, replay_unpack):
            function(*inputs)
        if not leaves:
            backward_boundary.exit()

    def unpack(holder: _Holder) -> torch.Tensor:
        if "tensors" in kept:
            recompute()
        if holder not in recomputed:
            raise RuntimeError("non_reentrant_checkpoint: the recomputation did not save a tensor the first run saved "
                               "(the region must run the same operations both times)")
        return recomputed[holder]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        everything, _ = _split_outputs(function(*args))
    kept["tensors"], kept["slots"] = _stash(args, options, mp)
    if leaves and (options.profile or options.synchronize_checkpoint_boundary):
        torch.autograd.graph.register_multi_grad_hook(list(leaves.values()), lambda _: backward_boundary.exit())
    forward_boundary.exit()
    return _result(everything)


# the region stays part of the caller's graph: a pipeline stage need not make its inputs require grad for it
# (hf_zero/pipeline/module.py:_attached)
non_reentrant_checkpoint.keeps_graph = True
# in a pipeline stage the reentrant checkpoint runs as the non-reentrant one (hf_zero/pipeline/module.py:run_chunk)
checkpoint.in_pipeline_stage = non_reentrant_checkpoint
