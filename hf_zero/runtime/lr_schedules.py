"""DeepSpeed's learning-rate schedules, with DeepSpeed's names, defaults and numbers.

A DeepSpeed config's ``"scheduler": {"type": "WarmupLR", "params": {...}}`` must produce the same learning rate
at every step under hf_zero as under DeepSpeed, and a checkpoint's ``lr_scheduler`` entry
(``{"last_batch_iteration": n}``) must load in either. So each class here keeps DeepSpeed's constructor
(parameter names, order, defaults) and its arithmetic, including the quirks users' tuned configs depend on:

- ``warmup_num_steps`` is raised to at least 2 (the log warmup divides by ``log(warmup_num_steps)``); 0 is accepted
  and means 2, as in DeepSpeed;
- log warmup: ``gamma = log(step + 1) / log(warmup_num_steps)``; linear warmup: ``gamma = step / warmup_num_steps``;
- ``OneCycle`` cycles ``betas[0]`` (never SGD's ``momentum``) and pins ``betas[1]`` to 0.99;
- a schedule built with ``last_batch_iteration == -1`` writes its first learning rate into the optimizer at
  construction (``OneCycle`` excepted), and ``get_last_lr()`` answers from then on; one resumed with another
  ``last_batch_iteration`` (or ``OneCycle``) raises ``AssertionError("need to call step() first")`` until the
  first ``step()`` -- transformers' Trainer catches exactly that message while fp16 loss scaling skips steps.

Where DeepSpeed silently accepts a mistake, hf_zero refuses it: an unknown ``warmup_type`` is an error here
(DeepSpeed logs a warning and falls back to "log"), and :func:`build_lr_scheduler` rejects unknown, missing and
wrongly typed ``scheduler.params`` keys with a :class:`~hf_zero.config.errors.ConfigError` naming the key.

``step()`` is called once per optimizer step (not per micro-batch, not per epoch); ``last_batch_iteration`` counts
optimizer steps taken so far, starting at -1.
"""

from __future__ import annotations

import inspect
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hf_zero.config.errors import ConfigError, check_keys, closest

__all__ = [
    "VALID_LR_SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "build_lr_scheduler",
    "add_tuning_arguments",
    "get_config_from_args",
    "get_lr_from_config",
]

logger = logging.getLogger(__name__)

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
# Order and content match deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES: accelerate tests
# ``type(scheduler).__name__ in VALID_LR_SCHEDULES`` to decide whether the engine steps the scheduler.
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
_WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)

# OneCycle writes (cycled_beta0, 0.99) into every group's ``betas``, as DeepSpeed does.
_ONE_CYCLE_BETA1 = 0.99


class _ParamError(ValueError):
    """A bad constructor argument; :func:`build_lr_scheduler` re-raises it as ``scheduler.params.<param>``."""

    def __init__(self, param: str, detail: str):
        self.param = param
        self.detail = detail
        super().__init__(f"{param}: {detail}")


# ---------------------------------------------------------------------------------------------------------------
# argument checks (shared by direct construction and the config factory)


def _show(value: Any) -> str:
    hint = ' ("auto" is only filled in by transformers/accelerate; set a number here)' if value == "auto" else ""
    return f"{value!r} ({type(value).__name__}){hint}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(param: str, value: Any) -> float:
    if not _is_number(value) or math.isnan(value):
        raise _ParamError(param, f"expected a number, got {_show(value)}")
    return value


def _check_int(param: str, value: Any, *, minimum: int) -> int:
    # JSON writers emit 2e3 for 2000; an integral float is the integer the user meant.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _ParamError(param, f"expected an integer >= {minimum}, got {_show(value)}")
    if value < minimum:
        raise _ParamError(param, f"expected an integer >= {minimum}, got {value}")
    return value


def _check_bool(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _ParamError(param, f"expected true or false, got {_show(value)}")
    return value


def _check_warmup_type(value: Any) -> str:
    if value not in _WARMUP_TYPES:
        # DeepSpeed logs a warning and warms up with "log" instead: a typo would train on another schedule
        raise _ParamError("warmup_type", f"expected 'log' or 'linear', got {_show(value)} (DeepSpeed would warn and "
                                         f"warm up with 'log'; write 'log' for that)")
    return value


def _per_group(param_groups: Sequence[dict], param: str, value: Any) -> list[float]:
    """Broadcast a scalar to every param group, or check a per-group list (DeepSpeed's ``_format_param``)."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(param_groups):
            raise _ParamError(param, f"expected one value per optimizer param group ({len(param_groups)}), "
                                     f"got a list of {len(value)}")
        return [_check_number(param, v) for v in value]
    return [_check_number(param, value)] * len(param_groups)


def _param_groups_owner(optimizer: Any) -> Any:
    """The object whose ``param_groups`` the schedule writes: the optimizer, or the one a wrapper holds."""
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise TypeError(f"{type(optimizer).__name__} has no param_groups; pass a torch.optim.Optimizer "
                    f"(or an object with .param_groups)")


def _update_lr(param_groups: Sequence[dict], lrs: Sequence[float]) -> list[Any]:
    """Write ``lrs`` into the groups (in place for tensor learning rates) and return the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        current = group["lr"]
        if _is_tensor(current):
            current.fill_(lr.squeeze() if _is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _is_tensor(value: Any) -> bool:
    # No torch import here: a tensor lr implies torch is already imported, and float lrs need none.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


# ---------------------------------------------------------------------------------------------------------------
# schedules


class _Schedule:
    """What every DeepSpeed schedule shares: the step counter, ``step``, ``get_last_lr`` and the state dict."""

    optimizer: Any
    last_batch_iteration: int

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def get_last_lr(self) -> list[Any]:
        """The learning rates the last ``step()`` (or construction from scratch) wrote into the optimizer."""
        assert getattr(self, "_last_lr", None) is not None, "need to call step() first"
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: one more than now) and write the new learning rates."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _update_lr(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict[str, int]:
        # DeepSpeed's checkpoint format: the counter is the whole state, everything else comes from the config.
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class LRRangeTest(_Schedule):
    """Learning-rate range test: ``lr = min_lr * (1 + step_rate * interval)`` with
    ``interval = (last_batch_iteration + 1) / step_size``, floored when ``lr_range_test_staircase``.

    Used to find the largest learning rate that still trains, before choosing OneCycle bounds.
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        self.optimizer = _param_groups_owner(optimizer)
        groups = self.optimizer.param_groups
        self.min_lr = _per_group(groups, "lr_range_test_min_lr", lr_range_test_min_lr)
        self.step_size = _check_int("lr_range_test_step_size", lr_range_test_step_size, minimum=1)
        self.step_rate = _check_number("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = _check_bool("lr_range_test_staircase", lr_range_test_staircase)
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, minimum=-1)
        if self.last_batch_iteration == -1:
            self._last_lr = _update_lr(groups, self.min_lr)

    def _interval(self) -> float:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def get_lr(self) -> list[float]:
        increase = 1 + self.step_rate * self._interval()
        return [min_lr * increase for min_lr in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle: lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size`` steps, falls back
    over ``cycle_second_step_size`` (default: the first), then decays as ``min_lr / (1 + decay_lr_rate * k)`` with
    ``k = steps_after_cycle / decay_step_size`` (no decay when ``decay_step_size`` or the rate is 0).

    With ``cycle_momentum`` and an optimizer that has ``betas`` (Adam family), ``betas[0]`` moves inversely to the
    lr between ``cycle_max_mom`` and ``cycle_min_mom`` and ``betas[1]`` is set to 0.99; after the cycle it grows as
    ``max_mom * (1 + decay_mom_rate * k)``. A stair count > 0 moves lr/momentum in that many flat stairs per half.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: float | Sequence[float], cycle_max_lr: float | Sequence[float],
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float | Sequence[float] = 0.8,
                 cycle_max_mom: float | Sequence[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1):
        self.optimizer = _param_groups_owner(optimizer)
        groups = self.optimizer.param_groups
        last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, minimum=-1)

        # cycle shape (step sizes are floats in DeepSpeed; fractional sizes are legal)
        first = float(_check_number("cycle_first_step_size", cycle_first_step_size))
        if first <= 0:
            raise _ParamError("cycle_first_step_size", f"must be positive, got {cycle_first_step_size}")
        second = first if cycle_second_step_size is None else float(
            _check_number("cycle_second_step_size", cycle_second_step_size))
        if second < 0:
            raise _ParamError("cycle_second_step_size", f"must be >= 0, got {cycle_second_step_size}")
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = _check_int("cycle_first_stair_count", cycle_first_stair_count, minimum=0)
        self.second_stair_count = self.first_stair_count if cycle_second_stair_count is None else _check_int(
            "cycle_second_stair_count", cycle_second_stair_count, minimum=0)
        self.decay_step_size = _check_number("decay_step_size", decay_step_size)
        if self.decay_step_size < 0:
            raise _ParamError("decay_step_size", f"must be >= 0, got {decay_step_size}")
        no_decay_interval = math.isclose(self.decay_step_size, 0)

        # learning rate
        self.min_lrs = _per_group(groups, "cycle_min_lr", cycle_min_lr)
        self.max_lrs = _per_group(groups, "cycle_max_lr", cycle_max_lr)
        self.decay_lr_rate = _check_number("decay_lr_rate", decay_lr_rate)
        self.skip_lr_decay = no_decay_interval or math.isclose(self.decay_lr_rate, 0)

        # momentum
        self.cycle_momentum = _check_bool("cycle_momentum", cycle_momentum)
        self.decay_mom_rate = _check_number("decay_mom_rate", decay_mom_rate)
        self.skip_mom_decay = no_decay_interval or math.isclose(self.decay_mom_rate, 0)
        min_moms = _per_group(groups, "cycle_min_mom", cycle_min_mom)
        max_moms = _per_group(groups, "cycle_max_mom", cycle_max_mom)
        self.min_moms = [(mom, _ONE_CYCLE_BETA1) for mom in min_moms]
        self.max_moms = [(mom, _ONE_CYCLE_BETA1) for mom in max_moms]
        if self.cycle_momentum and "betas" not in (getattr(self.optimizer, "defaults", None) or {}):
            logger.warning("OneCycle: cycle_momentum is disabled because optimizer %s has no 'betas' in its "
                           "defaults (only Adam-style betas[0] is cycled)", type(self.optimizer).__name__)
            self.cycle_momentum = False

        # Both bounds are validated before the optimizer is touched, so a bad value leaves it unchanged.
        if last_batch_iteration == -1:
            _update_lr(groups, self.min_lrs)
            if self.cycle_momentum:
                for group, betas in zip(groups, self.min_moms):
                    group["betas"] = betas
        self.last_batch_iteration = last_batch_iteration

    def _scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle  # position within the cycle, in [0, 1)
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:
            # Quantise from the integer offset, not from ``scale``: the float scale at a half-cycle boundary can land
            # 1e-16 under an exact stair, and flooring that would drop a whole stair (off the peak, even).
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale = math.floor(stair_position) / stair_count
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        factor = 1 + self.decay_lr_rate * interval
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The ``betas`` this step writes, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        factor = 1 + self.decay_mom_rate * interval
        return [(beta0 * factor, beta1) for beta0, beta1 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class WarmupLR(_Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps, then hold.

    ``lr = min_lr + (max_lr - min_lr) * gamma``; ``gamma = log(step + 1) / log(warmup_num_steps)`` ("log") or
    ``step / warmup_num_steps`` ("linear") during warmup, 1 afterwards. ``warmup_max_lr=None`` takes each group's
    current lr.
    """

    def __init__(self, optimizer: Any, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        # 0 ("no warmup", what accelerate's DeepSpeed tests pass) is accepted as DeepSpeed does: raised to 2 below
        warmup_num_steps = _check_int("warmup_num_steps", warmup_num_steps, minimum=0)
        self.optimizer = _param_groups_owner(optimizer)
        groups = self.optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in groups]  # float() also reads a tensor lr
        self.min_lrs = _per_group(groups, "warmup_min_lr", warmup_min_lr)
        self.max_lrs = _per_group(groups, "warmup_max_lr", warmup_max_lr)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, minimum=-1)
        if self.last_batch_iteration == -1:
            self._last_lr = _update_lr(groups, self.get_lr())

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _warmup_gamma(self) -> float:
        if self.warmup_type == WARMUP_LOG_RATE:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``:
    ``gamma = max(0, (total - step) / max(1, total - warmup_num_steps))`` after warmup."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, minimum=1)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                           total_num_steps, warmup_num_steps)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Scale each group's own lr by a ratio: warm up from ``warmup_min_ratio`` to 1 over ``warmup_num_steps``
    (log or linear), then follow half a cosine down to ``cos_min_ratio`` at ``total_num_steps`` and stay there."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        # 0 ("no warmup", what accelerate's DeepSpeed tests pass) is accepted as DeepSpeed does: raised to 2 below
        warmup_num_steps = _check_int("warmup_num_steps", warmup_num_steps, minimum=0)
        self.optimizer = _param_groups_owner(optimizer)
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, minimum=1)
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, minimum=-1)
        self.cos_min_ratio = _check_number("cos_min_ratio", cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.warmup_min_ratio = _check_number("warmup_min_ratio", warmup_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                           total_num_steps, warmup_num_steps)
        # The base lrs are read once: later steps overwrite group["lr"], the ratio always applies to the original.
        self.org_lrs = [group["lr"].clone() if _is_tensor(group["lr"]) else group["lr"]
                        for group in self.optimizer.param_groups]
        if self.last_batch_iteration == -1:
            self._last_lr = _update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == WARMUP_LOG_RATE:
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            else:
                ratio = self.last_batch_iteration / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped at 1 so the ratio stays at cos_min_ratio past the end instead of climbing back up.
        progress = min(1.0, real_last_step / real_total_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [org_lr * ratio for org_lr in self.org_lrs]


# ---------------------------------------------------------------------------------------------------------------
# config factory

_SCHEDULES: dict[str, type[_Schedule]] = {
    LR_RANGE_TEST: LRRangeTest,
    ONE_CYCLE: OneCycle,
    WARMUP_LR: WarmupLR,
    WARMUP_DECAY_LR: WarmupDecayLR,
    WARMUP_COSINE_LR: WarmupCosineLR,
}


def build_lr_scheduler(type_name: str, params: Mapping[str, Any] | None, optimizer: Any) -> _Schedule:
    """Build the schedule a config's ``"scheduler": {"type": type_name, "params": params}`` describes.

    Raises :class:`ConfigError` naming ``scheduler.type`` or ``scheduler.params.<key>`` for an unknown schedule,
    an unknown or missing parameter, or a value of the wrong type or range.
    """
    cls = _SCHEDULES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        guess = closest(type_name, VALID_LR_SCHEDULES) if isinstance(type_name, str) else None
        hint = f"; did you mean {guess!r}?" if guess else ""
        raise ConfigError("scheduler.type", f"unknown LR schedule {type_name!r}; expected one of "
                                            f"{', '.join(VALID_LR_SCHEDULES)}{hint}")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError("scheduler.params", f"expected a JSON object, got {_show(params)}")

    signature = inspect.signature(cls.__init__)
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    check_keys(params, accepted, "scheduler.params", f"not a parameter of {type_name}")
    for name in accepted:
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params:
            raise ConfigError(f"scheduler.params.{name}", f"required by {type_name} but missing")
    try:
        return cls(optimizer, **params)
    except _ParamError as err:
        raise ConfigError(f"scheduler.params.{err.param}", f"{err.detail} (scheduler {type_name})") from None


# DeepSpeed's command-line tuning helpers live in this module's namespace there; they are kept in their own file here.
from .lr_tuning import add_tuning_arguments, get_config_from_args, get_lr_from_config, parse_arguments  # noqa: E402
