"""``optimizer`` and ``scheduler``: a type name and its ``params``, checked against that type's parameter names.

DeepSpeed passes ``params`` straight to the optimizer / scheduler constructor, so a typo surfaces as a ``TypeError``
deep inside initialisation, or not at all. Here each type has a small dataclass of its parameters (DeepSpeed's
names and defaults); the user's ``params`` are parsed against it, converted ("1e-4" -> 1e-4, a list -> a tuple),
and kept as a mapping holding only the keys the user wrote, so constructor defaults still apply downstream.
Every parameter may be ``"auto"`` (HF fills lr, betas, eps, weight_decay, warmup and total steps).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigError
from .schema import Auto, json_key, parse, spec

__all__ = ["OPTIMIZER_TYPES", "SCHEDULER_TYPES", "OptimizerConfig", "SchedulerConfig", "ONE_BIT_OPTIMIZERS"]


def _p(default: Any = dataclasses.MISSING, *, help: str) -> Any:
    return spec(default, auto=True, help=help)


# --- optimizer parameters -------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class AdamParams:
    lr: float | Auto = _p(1e-3, help="Learning rate.")
    betas: tuple[float, float] | Auto = _p((0.9, 0.999), help="Coefficients of the running averages.")
    eps: float | Auto = _p(1e-8, help="Added to the denominator for numerical stability.")
    weight_decay: float | Auto = _p(0.0, help="Weight decay (decoupled for AdamW / adam_w_mode).")
    bias_correction: bool | Auto = _p(True, help="Apply Adam's bias correction.")
    adam_w_mode: bool | Auto = _p(True, help="Decoupled weight decay (AdamW); Adam's default is L2 when false.")
    amsgrad: bool | Auto = _p(False, help="Use the AMSGrad variant.")
    torch_adam: bool | Auto = _p(False, help="Use torch.optim.Adam/AdamW instead of the fused kernel.")
    fused: bool | None | Auto = _p(None, help="With torch_adam: torch's fused implementation.")


@dataclass(frozen=True, kw_only=True)
class SGDParams:
    lr: float | Auto = _p(1e-3, help="Learning rate.")
    momentum: float | Auto = _p(0.0, help="Momentum factor.")
    dampening: float | Auto = _p(0.0, help="Dampening for momentum.")
    weight_decay: float | Auto = _p(0.0, help="L2 penalty.")
    nesterov: bool | Auto = _p(False, help="Nesterov momentum.")


@dataclass(frozen=True, kw_only=True)
class LambParams:
    lr: float | Auto = _p(1e-3, help="Learning rate.")
    betas: tuple[float, float] | Auto = _p((0.9, 0.999), help="Coefficients of the running averages.")
    eps: float | Auto = _p(1e-8, help="Added to the denominator for numerical stability.")
    weight_decay: float | Auto = _p(0.0, help="Weight decay.")
    max_coeff: float | Auto = _p(10.0, help="Upper bound of the layer-wise trust ratio.")
    min_coeff: float | Auto = _p(0.01, help="Lower bound of the layer-wise trust ratio.")
    bias_correction: bool | Auto = _p(True, help="Apply bias correction.")


@dataclass(frozen=True, kw_only=True)
class AdagradParams:
    lr: float | Auto = _p(1e-2, help="Learning rate.")
    eps: float | Auto = _p(1e-10, help="Added to the denominator for numerical stability.")
    weight_decay: float | Auto = _p(0.0, help="L2 penalty.")
    amsgrad: bool | Auto = _p(False, help="Accepted for DeepSpeed compatibility; unused by Adagrad.")


@dataclass(frozen=True, kw_only=True)
class LionParams:
    lr: float | Auto = _p(1e-3, help="Learning rate.")
    betas: tuple[float, float] | Auto = _p((0.9, 0.99), help="Coefficients of the update and momentum averages.")
    weight_decay: float | Auto = _p(0.0, help="Decoupled weight decay.")


@dataclass(frozen=True, kw_only=True)
class OneBitAdamParams(AdamParams):
    freeze_step: int | Auto = _p(100_000, help="Warm-up steps with uncompressed communication.")
    eps_inside_sqrt: bool | Auto = _p(False, help="Put eps inside the square root.")
    max_grad_norm: float | Auto = _p(0.0, help="Gradient clipping inside the optimizer.")
    cuda_aware: bool | Auto = _p(False, help="CUDA-aware MPI communication.")
    comm_backend_name: str | Auto = _p("nccl", help="Backend of the compressed communication.")


@dataclass(frozen=True, kw_only=True)
class ZeroOneAdamParams(OneBitAdamParams):
    var_freeze_step: int | Auto = _p(100_000, help="Step after which the variance is frozen.")
    var_update_scaler: int | Auto = _p(16, help="Interval growth of variance updates.")
    local_step_scaler: int | Auto = _p(32_678, help="Interval growth of local steps.")
    local_step_clipper: int | Auto = _p(16, help="Largest local-step interval.")


@dataclass(frozen=True, kw_only=True)
class OneBitLambParams(OneBitAdamParams):
    max_coeff: float | Auto = _p(10.0, help="Upper bound of the layer-wise trust ratio.")
    min_coeff: float | Auto = _p(0.01, help="Lower bound of the layer-wise trust ratio.")
    coeff_beta: float | Auto = _p(0.9, help="Averaging coefficient of the frozen trust ratio.")
    factor_max: float | Auto = _p(4.0, help="Upper bound of the trust-ratio scaling factor.")
    factor_min: float | Auto = _p(0.5, help="Lower bound of the trust-ratio scaling factor.")
    factor_threshold: float | Auto = _p(0.1, help="Threshold of the trust-ratio scaling factor update.")


# lowercased name -> (name as DeepSpeed documents it, parameter schema)
OPTIMIZER_TYPES: dict[str, tuple[str, type]] = {
    "adam": ("Adam", AdamParams),
    "adamw": ("AdamW", AdamParams),
    "sgd": ("SGD", SGDParams),
    "lamb": ("Lamb", LambParams),
    "adagrad": ("Adagrad", AdagradParams),
    "lion": ("Lion", LionParams),
    "onebitadam": ("OneBitAdam", OneBitAdamParams),
    "zerooneadam": ("ZeroOneAdam", ZeroOneAdamParams),
    "onebitlamb": ("OneBitLamb", OneBitLambParams),
}
# Communication-compressed optimizers: accepted, reported as not implemented.
ONE_BIT_OPTIMIZERS = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})


# --- scheduler parameters ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class WarmupLRParams:
    warmup_min_lr: float | Auto = _p(0.0, help="Learning rate at step 0.")
    warmup_max_lr: float | Auto = _p(0.001, help="Learning rate at the end of warm-up.")
    warmup_num_steps: int | Auto = _p(1000, help="Warm-up steps.")
    warmup_type: Literal["log", "linear"] | Auto = _p("log", help="Warm-up curve: 'log' or 'linear'.")
    last_batch_iteration: int | Auto = _p(-1, help="Step to resume from; -1 starts fresh.")


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: int | Auto = _p(help="Total training steps; the rate decays linearly to 0 at this step.")


@dataclass(frozen=True, kw_only=True)
class WarmupCosineLRParams:
    total_num_steps: int | Auto = _p(help="Total training steps.")
    warmup_min_ratio: float | Auto = _p(0.0, help="Learning-rate ratio at step 0.")
    warmup_num_steps: int | Auto = _p(1000, help="Warm-up steps.")
    cos_min_ratio: float | Auto = _p(0.0001, help="Learning-rate ratio at the end of the cosine decay.")
    warmup_type: Literal["log", "linear"] | Auto = _p("log", help="Warm-up curve: 'log' or 'linear'.")
    last_batch_iteration: int | Auto = _p(-1, help="Step to resume from; -1 starts fresh.")


@dataclass(frozen=True, kw_only=True)
class OneCycleParams:
    cycle_min_lr: float | Auto = _p(help="Lowest learning rate of the cycle.")
    cycle_max_lr: float | Auto = _p(help="Highest learning rate of the cycle.")
    decay_lr_rate: float | Auto = _p(0.0, help="Learning-rate decay after the cycle.")
    cycle_first_step_size: int | Auto = _p(2000, help="Steps of the rising half of the cycle.")
    cycle_second_step_size: int | None | Auto = _p(None, help="Steps of the falling half; default: the first's.")
    cycle_first_stair_count: int | Auto = _p(0, help="Stairs in the rising half; 0 is smooth.")
    cycle_second_stair_count: int | None | Auto = _p(None, help="Stairs in the falling half.")
    decay_step_size: int | Auto = _p(0, help="Steps between decays after the cycle.")
    cycle_momentum: bool | Auto = _p(True, help="Cycle momentum inversely to the learning rate.")
    cycle_min_mom: float | Auto = _p(0.8, help="Lowest momentum.")
    cycle_max_mom: float | Auto = _p(0.9, help="Highest momentum.")
    decay_mom_rate: float | Auto = _p(0.0, help="Momentum decay after the cycle.")
    last_batch_iteration: int | Auto = _p(-1, help="Step to resume from; -1 starts fresh.")


@dataclass(frozen=True, kw_only=True)
class LRRangeTestParams:
    lr_range_test_min_lr: float | Auto = _p(1e-3, help="Starting learning rate.")
    lr_range_test_step_size: int | Auto = _p(2000, help="Steps between increases.")
    lr_range_test_step_rate: float | Auto = _p(1.0, help="Increase per step_size.")
    lr_range_test_staircase: bool | Auto = _p(False, help="Increase in stairs instead of continuously.")
    last_batch_iteration: int | Auto = _p(-1, help="Step to resume from; -1 starts fresh.")


SCHEDULER_TYPES: dict[str, tuple[str, type]] = {
    "warmuplr": ("WarmupLR", WarmupLRParams),
    "warmupdecaylr": ("WarmupDecayLR", WarmupDecayLRParams),
    "warmupcosinelr": ("WarmupCosineLR", WarmupCosineLRParams),
    "onecycle": ("OneCycle", OneCycleParams),
    "lrrangetest": ("LRRangeTest", LRRangeTestParams),
}


def _typed_params(params_cls: type, params: Mapping[str, Any], type_name: str) -> Mapping[str, Any]:
    """``params`` checked and converted against ``params_cls``; only the keys given are kept."""
    try:
        parsed = parse(params_cls, dict(params), "params")
    except ConfigError as err:
        raise ConfigError(err.key_path, f"{err.detail} (parameters of {type_name})") from None
    by_key = {json_key(f): f.name for f in dataclasses.fields(params_cls)}
    return types.MappingProxyType({key: getattr(parsed, by_key[key]) for key in params})


def _lookup(table: dict[str, tuple[str, type]], given: str, what: str) -> tuple[str, type]:
    entry = table.get(given.lower())
    if entry is None:
        accepted = ", ".join(display for display, _ in table.values())
        raise ConfigError("type", f"unknown {what} type {given!r}; accepted (any case): {accepted}")
    return entry


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """``optimizer``: the optimizer hf_zero builds when none is passed to ``initialize``."""

    type: str = spec(help="Optimizer type, any case: Adam, AdamW, SGD, Lamb, Adagrad, Lion, OneBitAdam, ...")
    params: Mapping[str, Any] = spec(default_factory=dict, help="Constructor arguments of that optimizer.")
    # DeepSpeed reads only type, params and legacy_fusion here; these two, written beside params instead of in it
    # (DeepSpeed's own fp16 tests do), it ignores -- and so, with a warning, does hf_zero (config/status.py)
    torch_adam: bool | None = spec(None, help="Ignored here (DeepSpeed reads it from optimizer.params).")
    adam_w_mode: bool | None = spec(None, help="Ignored here (DeepSpeed reads it from optimizer.params).")
    legacy_fusion: bool | None = spec(None, help="DeepSpeed's legacy fused fp16 optimizer switch.")
    name: str = spec("", json=False, help="The type lowercased (adam, adamw, sgd, ...), for dispatch.")

    def __post_init__(self) -> None:
        display, params_cls = _lookup(OPTIMIZER_TYPES, self.type, "optimizer")
        object.__setattr__(self, "name", self.type.lower())
        object.__setattr__(self, "params", _typed_params(params_cls, self.params, display))


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """``scheduler``: the learning-rate schedule hf_zero builds when none is passed to ``initialize``."""

    type: str = spec(help="Scheduler type, any case: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.")
    params: Mapping[str, Any] = spec(default_factory=dict, help="Constructor arguments of that scheduler.")
    name: str = spec("", json=False, help="The type lowercased (warmuplr, ...), for dispatch.")

    def __post_init__(self) -> None:
        display, params_cls = _lookup(SCHEDULER_TYPES, self.type, "scheduler")
        object.__setattr__(self, "name", self.type.lower())
        object.__setattr__(self, "params", _typed_params(params_cls, self.params, display))
