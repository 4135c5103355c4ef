"""The DeepSpeed schema translated once into what the engine's parts act on: small frozen policies.

``zero/`` and ``offload/`` take these (or plain numbers), never a schema section or a dict, so a DeepSpeed key
reaches behaviour through exactly one translation: :func:`zero_policy`, :func:`precision_policy` and, for
``zero.Init`` (which reads a raw config before any engine exists), :func:`param_offload_policy`.

Offload variants are subclasses, tested with ``isinstance`` (FSDP2's ``OffloadPolicy``/``CPUOffloadPolicy``): a
section with ``device: none`` becomes ``None``, ``cpu`` a :class:`CPUOffloadPolicy`, ``nvme`` an
:class:`NVMeOffloadPolicy` that carries its directory and the ``aio`` numbers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

# stage3_model_persistence_threshold's default, DeepSpeed's sys.maxsize: no cap on the elements kept whole
NO_PERSISTENCE_CAP = 2**63 - 1

if TYPE_CHECKING:
    import torch

    from .hf_zero_config import HfZeroConfig
    from .sections import AioConfig, FP16Config, OffloadConfig

__all__ = ["AioParams", "OffloadPolicy", "CPUOffloadPolicy", "NVMeOffloadPolicy", "LeafModulePolicy", "Stage3Policy",
           "ZeroPolicy", "LossScalePolicy", "PrecisionPolicy", "zero_policy", "precision_policy", "loss_scale_policy",
           "param_offload_policy", "param_offload_device", "InitPrecision", "init_precision", "ZenFlowPolicy",
           "zenflow_policy"]


@dataclass(frozen=True)
class AioParams:
    """The ``aio`` section as plain numbers: how swap files are read and written."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1
    # Concurrent operations (one per tensor moved); 2 lets a tile's reads run while the previous tile is written.
    # single_submit in the config turns this down to 1 (one operation at a time).
    max_concurrent_ops: int = 2


@dataclass(frozen=True)
class OffloadPolicy:
    """Where a state lives when it is not on the compute device; use a subclass."""

    pin_memory: bool = False

    @property
    def device(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    @property
    def device(self) -> str:
        return "cpu"


@dataclass(frozen=True)
class NVMeOffloadPolicy(OffloadPolicy):
    nvme_path: str = ""
    aio: AioParams = AioParams()

    @property
    def device(self) -> str:
        return "nvme"


@dataclass(frozen=True)
class LeafModulePolicy:
    """``zero_optimization.leaf_module``: which modules ZeRO-3 makes leaves when the engine is built."""

    classes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    name_suffixes: tuple[str, ...] = ()
    # the config changed DeepSpeed's defaults: names or suffixes matching nothing, or nothing matched, are warned of
    warn_unmatched: bool = False


@dataclass(frozen=True)
class Stage3Policy:
    """ZeRO-3's gather schedule (all in elements, as DeepSpeed's keys)."""

    prefetch_bucket_numel: int
    max_live_numel: int
    max_reuse_distance: int
    persistence_threshold: int
    divergence_timeout_s: float
    # stage3_model_persistence_threshold: the most elements the persistence threshold may keep whole in total
    model_persistence_threshold: int = NO_PERSISTENCE_CAP
    # stage3_module_granularity_threshold: modules whose parameters per layer are at most this are gathered whole
    # (leaf modules, hf_zero/zero/leaf.py); 0 off
    module_granularity_threshold: int = 0
    # zero_optimization.leaf_module: leaves chosen by class, name or name suffix (hf_zero/zero/leaf.py)
    leaf_modules: LeafModulePolicy = LeafModulePolicy()
    # zero_optimization.log_trace_cache_warnings: a warning when a module asks for its parameters out of the
    # recorded order (hf_zero/zero/stage3/prefetch.py)
    log_trace_misses: bool = False


def persistent_parameters(numels: Sequence[int], param_threshold: int, model_threshold: int = NO_PERSISTENCE_CAP
                          ) -> list[bool]:
    """Which ZeRO-3 parameters stay whole on every rank, in model order (``named_parameters``): those of at most
    ``stage3_param_persistence_threshold`` elements, while their running total stays within
    ``stage3_model_persistence_threshold``. DeepSpeed's rule: a parameter that would pass the cap is skipped and a
    later, smaller one may still fit. Shared by the runtime and the memory estimator, so both keep the same set."""
    keep, total = [], 0
    for n in numels:
        fits = n <= param_threshold and total + n <= model_threshold
        keep.append(fits)
        total += n if fits else 0
    return keep


@dataclass(frozen=True)
class ZeroPolicy:
    stage: int
    reduce_bucket_numel: int
    allgather_bucket_numel: int
    overlap_comm: bool
    offload_optimizer: OffloadPolicy | None
    offload_ratio: float        # fraction of each optimizer shard offloaded (offload_optimizer.ratio)
    sub_group_size: int         # elements per offloaded optimizer tile
    offload_param: OffloadPolicy | None
    stage3: Stage3Policy
    # ignore_unused_parameters false (ZeroConfig.checks_unused_parameters): a trainable parameter without a
    # gradient in an accumulation window is an error at the step
    require_every_gradient: bool = False


@dataclass(frozen=True)
class ZenFlowPolicy:
    """``zero_optimization.zenflow`` (hf_zero/zero/zenflow.py turns the epochs into micro-steps at the first backward,
    when the initialize() dataloader is known)."""

    topk_ratio: float
    update_interval: int
    select_per_epoch: bool     # select_strategy 'epoch' or 'auto' (then select_interval 1)
    select_interval: int       # micro-steps, or epochs when select_per_epoch; 0: select once
    full_warm_up_rounds: int
    offload_moments: bool      # zenflow.offload: the selective moments live in CPU memory (same values)
    overlap_step: bool         # each window's offloaded update reaches the weights one window late (DeepSpeed's)


def zenflow_policy(cfg: "HfZeroConfig") -> ZenFlowPolicy | None:
    from .schema import Auto

    zf = cfg.zero.zenflow
    if zf is None:
        return None
    per_epoch = isinstance(zf.select_strategy, Auto) or zf.select_strategy == "epoch"
    interval = 1 if isinstance(zf.select_interval, Auto) else int(zf.select_interval)
    return ZenFlowPolicy(topk_ratio=float(zf.topk_ratio), update_interval=int(zf.update_interval),
                         select_per_epoch=per_epoch, select_interval=interval,
                         full_warm_up_rounds=int(zf.full_warm_up_rounds), offload_moments=bool(zf.offload),
                         overlap_step=bool(zf.overlap_step))


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16 loss scaling: ``static_scale`` > 0 fixes the scale, else dynamic from ``2**initial_scale_power``."""

    static_scale: float
    initial_scale_power: int
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float


@dataclass(frozen=True)
class PrecisionPolicy:
    compute_dtype: "torch.dtype"
    grad_dtype: "torch.dtype"            # the dtype gradients are accumulated and reduced in
    buffer_dtype: "torch.dtype | None" = None  # floating buffers are cast to it under fp16/bf16; None: left alone
    keep_in_fp32: "str | tuple[str, ...]" = "auto"  # buffer name patterns kept in fp32, or "auto" (the model's lists)


@dataclass(frozen=True)
class InitPrecision:
    """What ``zero.Init`` builds in: ``dtype`` for parameters and floating buffers (None: as built), and the buffer
    names kept in fp32 (``keep_in_fp32``, as in :class:`PrecisionPolicy`)."""

    dtype: "torch.dtype | None"
    keep_in_fp32: "str | tuple[str, ...]" = "auto"


def _aio(aio: "AioConfig") -> AioParams:
    return AioParams(block_size=int(aio.block_size), queue_depth=int(aio.queue_depth),
                     thread_count=int(aio.intra_op_parallelism), max_concurrent_ops=1 if aio.single_submit else 2)


def _offload(section: "OffloadConfig", aio: "AioConfig") -> OffloadPolicy | None:
    if section.device == "cpu":
        return CPUOffloadPolicy(pin_memory=bool(section.pin_memory))
    if section.device == "nvme":
        return NVMeOffloadPolicy(pin_memory=bool(section.pin_memory), nvme_path=os.fspath(section.nvme_path),
                                 aio=_aio(aio))
    return None


# stage3_max_reuse_distance when the config leaves it out. DeepSpeed's 1e9 keeps every parameter used in forward
# gathered until its backward (the turn-around is always "within" 1e9 elements), i.e. a whole copy of the model
# per rank at the end of forward: no memory below DDP's. 0 re-gathers each module for its backward (FSDP2's
# reshard_after_forward), a cost the prefetch hides. A value in the config is honoured as written.
STAGE3_REUSE_DISTANCE_DEFAULT = 0


def _stage3_reuse_distance(cfg: "HfZeroConfig") -> int:
    from .schema import primary_keys
    from .sections import ZeroConfig  # sections imports this module

    if "stage3_max_reuse_distance" in primary_keys(ZeroConfig, cfg.raw.get("zero_optimization")):
        return int(cfg.zero.stage3_max_reuse_distance)
    return STAGE3_REUSE_DISTANCE_DEFAULT


def zero_policy(cfg: "HfZeroConfig") -> ZeroPolicy:
    zero = cfg.zero
    return ZeroPolicy(
        stage=int(zero.stage), reduce_bucket_numel=int(zero.reduce_bucket_size),
        allgather_bucket_numel=int(zero.allgather_bucket_size),
        overlap_comm=bool(zero.overlap_comm) if zero.overlap_comm is not None else True,
        offload_optimizer=_offload(zero.offload_optimizer, cfg.aio), offload_ratio=float(zero.offload_optimizer.ratio),
        sub_group_size=int(zero.sub_group_size), offload_param=_offload(zero.offload_param, cfg.aio),
        require_every_gradient=zero.checks_unused_parameters,
        stage3=Stage3Policy(
            prefetch_bucket_numel=int(zero.stage3_prefetch_bucket_size),
            max_live_numel=int(zero.stage3_max_live_parameters),
            max_reuse_distance=_stage3_reuse_distance(cfg),
            persistence_threshold=int(zero.stage3_param_persistence_threshold),
            model_persistence_threshold=int(zero.stage3_model_persistence_threshold),
            divergence_timeout_s=float(zero.stage3_divergence_timeout_s),
            module_granularity_threshold=int(zero.stage3_module_granularity_threshold),
            leaf_modules=LeafModulePolicy(classes=zero.leaf_module.classes, names=zero.leaf_module.names,
                                          name_suffixes=zero.leaf_module.name_suffixes,
                                          warn_unmatched=zero.leaf_module.customized),
            log_trace_misses=bool(zero.log_trace_cache_warnings)))


def precision_policy(cfg: "HfZeroConfig") -> PrecisionPolicy:
    import torch  # lazy: importing the config must stay cheap

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    types = cfg.data_types
    accum = types.grad_accum_dtype
    return PrecisionPolicy(compute_dtype=cfg.compute_dtype, grad_dtype=dtypes[accum] if accum else cfg.compute_dtype,
                           buffer_dtype=dtypes[types.buffer_dtype] if types.buffer_dtype else None,
                           keep_in_fp32=_keep_setting(types.keep_in_fp32_modules))


def _keep_setting(value) -> "str | tuple[str, ...]":
    from .schema import Auto

    return "auto" if isinstance(value, Auto) else tuple(value)


def init_precision(raw: Mapping[str, Any]) -> InitPrecision:
    """``zero.Init``'s dtypes from a raw DeepSpeed dict (DeepSpeed's ``Init._set_dtype``): bfloat16 when
    ``bf16.enabled`` (or legacy ``bfloat16.enabled``) is true, float16 when ``fp16.enabled`` is, else None (the
    dtype the model is built in). An ``enabled`` still "auto" counts as off: nothing fills it before the model is
    built, and an fp32 build loses nothing. Only these sections and ``data_types`` are read."""
    import torch

    from .schema import parse
    from .sections import BF16Config, DataTypesConfig, FP16Config

    bf16_raw = raw.get("bf16", raw.get("bfloat16"))
    bf16 = parse(BF16Config, bf16_raw, "bf16" if "bf16" in raw else "bfloat16")
    fp16 = parse(FP16Config, raw.get("fp16"), "fp16")
    if bf16.enabled is True and fp16.enabled is True:
        raise ConfigError("bf16.enabled", "true together with fp16.enabled true; enable at most one of fp16 and bf16")
    dtype = torch.bfloat16 if bf16.enabled is True else torch.float16 if fp16.enabled is True else None
    types = parse(DataTypesConfig, raw.get("data_types"), "data_types")
    return InitPrecision(dtype=dtype, keep_in_fp32=_keep_setting(types.keep_in_fp32_modules))


def loss_scale_policy(fp16: "FP16Config") -> LossScalePolicy:
    """The ``fp16`` section's loss scaling (used by fp16 training and by float16 ``torch_autocast``)."""
    return LossScalePolicy(
        static_scale=float(fp16.loss_scale), initial_scale_power=int(fp16.initial_scale_power),
        window=int(fp16.loss_scale_window), hysteresis=int(fp16.hysteresis),
        consecutive_hysteresis=bool(fp16.consecutive_hysteresis), min_scale=float(fp16.min_loss_scale))


def _param_offload(raw: Mapping[str, Any], remote_device: str | None):
    """(the parsed ``offload_param`` section, the device zero.Init places parameters on): ``remote_device`` when
    given, else ``zero_optimization.offload_param.device`` (DeepSpeed's rule)."""
    from .schema import parse
    from .sections import ParamOffloadConfig

    zero = raw.get("zero_optimization")
    section = zero.get("offload_param") if isinstance(zero, Mapping) else None
    off = parse(ParamOffloadConfig, section, "zero_optimization.offload_param")
    return off, (remote_device if remote_device is not None else off.device)


def param_offload_device(raw: Mapping[str, Any], remote_device: str | None = None) -> str:
    """``zero.Init``'s parameter placement from a raw DeepSpeed dict: "none" (the training device), "cpu" or
    "nvme" -- ``remote_device`` when given, else ``zero_optimization.offload_param.device``."""
    return _param_offload(raw, remote_device)[1]


def param_offload_policy(raw: Mapping[str, Any], remote_device: str | None = None) -> OffloadPolicy | None:
    """``zero.Init``'s swap-file policy from a raw DeepSpeed dict, when its placement (:func:`param_offload_device`)
    is "nvme"; else None. Only ``offload_param`` and ``aio`` are read."""
    from .schema import parse
    from .sections import AioConfig

    off, device = _param_offload(raw, remote_device)
    if device != "nvme":
        return None
    if not isinstance(off.nvme_path, str):
        raise ConfigError("zero_optimization.offload_param.nvme_path",
                          "zero.Init(remote_device='nvme') needs it in the config passed as config_dict_or_path: "
                          "the directory for the swap files")
    return NVMeOffloadPolicy(pin_memory=bool(off.pin_memory), nvme_path=off.nvme_path,
                             aio=_aio(parse(AioConfig, raw.get("aio"), "aio")))
