"""DeepSpeed's elastic batch plan: one global batch size that a whole range of GPU counts can train with.

With ``"elasticity": {"enabled": true, ...}`` the user gives the largest acceptable global batch and the micro-batch
sizes a GPU may run; the plan picks the batch size that the most GPU counts divide evenly into
``micro_batch * gradient_accumulation_steps * world_size``. A job restarted on another valid count keeps the same
global batch (and so the same convergence); only the accumulation steps change.

How the batch is chosen (DeepSpeed 0.19.7, the last release with the section; 0.19.8 refuses it, hf_zero keeps
running it as the releases before did):

* version 0.1: each micro batch and their least common multiple is a *base*; a base is scaled by the largest highly
  composite number that keeps it within ``max_train_batch_size``. Each such candidate counts the data-parallel
  sizes in ``[min_gpus, max_gpus]`` it fits (``batch / micro`` divisible by the count, for some micro batch); the
  candidate with the most counts wins, ties going to the larger batch (``prefer_larger_batch``) or the smaller.
* version 0.2 (the default): the same search per node (``num_gpus_per_node / model_parallel_size`` data-parallel
  ranks each, the GPU range divided by ``num_gpus_per_node``), scaled back up. When the current world size is not
  among the resulting counts, the plan falls back to the largest (or smallest) multiple of ``micro * world`` within
  ``max_train_batch_size``, valid for that world size only.

:func:`elastic_plan` is the pure computation; :func:`apply_elasticity` is what ``load_config`` runs for a world size.
Every error is a :class:`~hf_zero.config.ConfigError` naming the key, and is also of DeepSpeed's class
(:class:`ElasticityError` and its two subclasses), so launcher code that catches DeepSpeed's classes still works.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .batch import BATCH_KEYS
from .errors import ConfigError, check_keys

__all__ = ["DEEPSPEED_ELASTICITY_CONFIG", "ELASTICITY", "ElasticityConfig", "ElasticityConfigError", "ElasticityError",
           "ElasticityIncompatibleWorldSize", "ElasticPlan", "apply_elasticity", "check_scheduler_config",
           "elastic_plan", "parse_elasticity", "scheduler_section"]

ELASTICITY = "elasticity"
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"  # environment: the section as the scheduler saw it (JSON)
LATEST_VERSION = 0.2
MINIMUM_DEEPSPEED_VERSION = "0.3.8"  # the first DeepSpeed release with elasticity
# The 38 smallest highly composite numbers (OEIS A002182): numbers with more divisors than any smaller one, so a
# batch that is one of them times a base fits the most GPU counts. DeepSpeed scales by exactly this list, which
# covers batch sizes up to 720720 times a base; a larger cap still scales by the last one.
_HIGHLY_COMPOSITE = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
                     10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200,
                     332640, 498960, 554400, 665280, 720720)


class ElasticityError(ConfigError):
    """DeepSpeed's ``deepspeed.elasticity.config.ElasticityError``: any elasticity error (also a ConfigError)."""


class ElasticityConfigError(ElasticityError):
    """A malformed or unusable ``elasticity`` section."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The job runs on a world size the elastic plan cannot train with."""


@dataclass(frozen=True)
class ElasticityConfig:
    """The ``elasticity`` section, checked; DeepSpeed's keys and defaults."""

    enabled: bool = False
    max_train_batch_size: int = 2000
    micro_batch_sizes: tuple[int, ...] = (2, 4, 6)
    min_gpus: int = 1
    max_gpus: int = 10000
    min_time: float = 0  # minutes a scheduler should let the job run before rescaling it; not used by the plan
    version: float = LATEST_VERSION
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1


@dataclass(frozen=True)
class ElasticPlan:
    """What the plan gives (DeepSpeed's ``compute_elastic_config`` returns the first three)."""

    train_batch_size: int
    valid_gpus: tuple[int, ...]  # the data-parallel world sizes that can train with train_batch_size
    # for world_size; without one, version 0.2's choice for the count it planned for, version 0.1: None
    micro_batch_size: int | None
    gradient_accumulation_steps: int | None = None  # for world_size; None without one


_KEYS = tuple(f.name for f in ElasticityConfig.__dataclass_fields__.values())


def parse_elasticity(section: Mapping[str, Any], path: str = ELASTICITY) -> ElasticityConfig:
    """Check ``section`` key by key. ``max_train_batch_size`` and ``micro_batch_sizes`` are required when enabled
    (DeepSpeed's rule); a disabled section keeps the defaults for them."""
    if not isinstance(section, Mapping):
        raise ElasticityConfigError(path, f"must be a JSON object, got {type(section).__name__}")
    check_keys(section, _KEYS, path, error=ElasticityConfigError)
    enabled = _bool(section, "enabled", False, path)
    if enabled:
        for key, example in (("max_train_batch_size", "2000"), ("micro_batch_sizes", "[2, 4, 6]")):
            if key not in section:
                raise ElasticityConfigError(f"{path}.{key}", f"missing; an enabled elasticity section must give it "
                                                             f"(e.g. {example})")
    micro = section.get("micro_batch_sizes", [2, 4, 6])
    if not isinstance(micro, list) or not micro:
        raise ElasticityConfigError(f"{path}.micro_batch_sizes", f"{micro!r}: must be a non-empty list of positive "
                                                                 f"integers (the micro batches a GPU may run)")
    if not all(_is_int(m) and m > 0 for m in micro):
        raise ElasticityConfigError(f"{path}.micro_batch_sizes", f"{micro!r}: every entry must be a positive integer")
    cfg = ElasticityConfig(
        enabled=enabled,
        max_train_batch_size=_int(section, "max_train_batch_size", 2000, path),
        micro_batch_sizes=tuple(micro),
        min_gpus=_int(section, "min_gpus", 1, path, minimum=1),
        max_gpus=_int(section, "max_gpus", 10000, path, minimum=1),
        min_time=_number(section, "min_time", 0, path),
        version=_version(section, path),
        prefer_larger_batch=_bool(section, "prefer_larger_batch", True, path),
        ignore_non_elastic_batch_info=_bool(section, "ignore_non_elastic_batch_info", False, path),
        num_gpus_per_node=_int(section, "num_gpus_per_node", 1, path, minimum=1),
        model_parallel_size=_int(section, "model_parallel_size", 1, path, minimum=1),
    )
    if cfg.max_gpus < cfg.min_gpus:
        raise ElasticityConfigError(f"{path}.max_gpus", f"{cfg.max_gpus} is below {path}.min_gpus {cfg.min_gpus}")
    return cfg


def elastic_plan(config: ElasticityConfig, world_size: int | None = None, *,
                 target_deepspeed_version: str | None = None, planning_world_size: int | None = None,
                 path: str = ELASTICITY) -> ElasticPlan:
    """The batch size and valid GPU counts of ``config`` (enabled or not: the caller decides), and with
    ``world_size`` its micro batch and accumulation steps, checking that the world size is one of the counts.

    Version 0.2 plans for the GPUs the job has now: ``planning_world_size``, default ``world_size``.
    ``target_deepspeed_version`` (a scheduler's question: can that DeepSpeed run this plan?) must be >= 0.3.8.
    """
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    version = config.version
    if config.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"{path}.model_parallel_size",
                                    f"{config.model_parallel_size} needs {path}.version 0.2; version {version} "
                                    f"plans data parallelism only")
    if version > LATEST_VERSION:
        raise ElasticityConfigError(f"{path}.version", f"{version}: the latest elasticity version is {LATEST_VERSION}")
    if target_deepspeed_version is not None:
        _check_target_version(target_deepspeed_version)
    if version == 0.1:
        batch, counts = _plan_v01(config, config.max_train_batch_size, config.min_gpus, config.max_gpus, path)
        valid, micro = counts or (), None
    elif version == 0.2:
        gpus = planning_world_size if planning_world_size is not None else world_size
        if gpus is None:
            raise ElasticityConfigError(f"{path}.version", "0.2 plans for the number of GPUs the job runs on, and "
                                                           "none was given: pass the world size "
                                                           "(compute_elastic_config also reads WORLD_SIZE), or use "
                                                           "version 0.1")
        batch, valid, micro = _plan_v02(config, gpus, path)
    else:
        raise ElasticityConfigError(f"{path}.version", f"{version}: elasticity has versions 0.1 and 0.2")
    if world_size is None:
        return ElasticPlan(batch, valid, micro)
    if world_size not in valid:
        counts = f"the valid GPU counts are {list(valid)}" if valid else (
            f"no GPU count between {path}.min_gpus {config.min_gpus} and {path}.max_gpus {config.max_gpus} fits it")
        raise ElasticityIncompatibleWorldSize(
            path, f"world size {world_size} cannot train with the elastic batch size {batch} "
                  f"(max_train_batch_size {config.max_train_batch_size}, micro_batch_sizes "
                  f"{list(config.micro_batch_sizes)}): {counts}. Run on one of them or change the section")
    # the largest micro batch that divides this rank count's share (one does for every count the search found;
    # DeepSpeed asserts it)
    micro = max((m for m in config.micro_batch_sizes if batch // world_size % m == 0), default=None)
    if micro is None:
        raise ElasticityConfigError(f"{path}.micro_batch_sizes",
                                    f"none of {list(config.micro_batch_sizes)} divides the elastic batch size {batch} "
                                    f"/ world size {world_size}")
    return ElasticPlan(batch, valid, micro, batch // (micro * world_size))


def apply_elasticity(config: ElasticityConfig, world_size: int, batch_keys_given: Mapping[str, Any], *,
                     scheduler_section: Mapping[str, Any] | None = None) -> ElasticPlan:
    """The plan ``load_config`` trains with on ``world_size`` data-parallel ranks (``config`` enabled).

    ``batch_keys_given``: the batch keys the config sets, with their values. DeepSpeed refuses them beside an enabled
    section -- the plan overrides them -- unless ``ignore_non_elastic_batch_info`` is true. ``scheduler_section``: the
    section the resource scheduler planned with (DeepSpeed's ``DEEPSPEED_ELASTICITY_CONFIG``), which must agree.
    """
    if scheduler_section is not None:
        check_scheduler_config(config, scheduler_section)
    plan = elastic_plan(config, world_size)
    if plan.train_batch_size < 1:
        # version 0.2's fallback when micro_batch * world_size is already above the cap (DeepSpeed fails later, on
        # its batch assertion)
        raise ElasticityConfigError(f"{ELASTICITY}.max_train_batch_size",
                                    f"{config.max_train_batch_size} is below the smallest batch world size "
                                    f"{world_size} can run (micro batch {min(config.micro_batch_sizes)} per GPU); "
                                    f"raise it or run on fewer GPUs")
    if batch_keys_given and not config.ignore_non_elastic_batch_info:
        key = next(k for k in BATCH_KEYS if k in batch_keys_given)
        planned = dict(zip(BATCH_KEYS, (plan.train_batch_size, plan.micro_batch_size,
                                        plan.gradient_accumulation_steps)))
        raise ElasticityConfigError(
            key, f"{batch_keys_given[key]!r} is set, but {ELASTICITY}.enabled is true and the elastic plan sets the "
                 f"batch sizes ({', '.join(f'{k} {v}' for k, v in planned.items())} on world size {world_size}). "
                 f"Remove {', '.join(k for k in BATCH_KEYS if k in batch_keys_given)}, or set "
                 f"{ELASTICITY}.ignore_non_elastic_batch_info true to let the plan override them")
    return plan


def check_scheduler_config(config: ElasticityConfig, scheduler_section: Mapping[str, Any]) -> None:
    """The scheduler sized the job from its copy of the section: the keys the plan depends on must be the same."""
    theirs = parse_elasticity(scheduler_section, path="DEEPSPEED_ELASTICITY_CONFIG")
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        mine, scheduled = getattr(config, key), getattr(theirs, key)
        if mine != scheduled:
            raise ElasticityConfigError(f"{ELASTICITY}.{key}", f"{_show(mine)}, but the resource scheduler planned "
                                                               f"this job with {_show(scheduled)} (environment "
                                                               f"variable DEEPSPEED_ELASTICITY_CONFIG)")


def scheduler_section(text: str | None) -> Any:
    """The scheduler's section from the value of ``DEEPSPEED_ELASTICITY_CONFIG`` (None when it is unset)."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ElasticityConfigError(DEEPSPEED_ELASTICITY_CONFIG, f"(environment variable) is not valid JSON "
                                                                 f"({err.msg}): {text!r}") from None


# ---- the two versions of the search ------------------------------------------------------------------------

def _plan_v01(config: ElasticityConfig, cap: int, min_gpus: int, max_gpus: int,
              path: str) -> tuple[int, tuple[int, ...] | None]:
    """The batch and its GPU counts; counts None when no candidate fits any count in the range and none is
    preferred over DeepSpeed's starting point (the smallest micro batch), () when the preferred one fits none."""
    micro = config.micro_batch_sizes
    # version 0.2 passes per-node values, which can round to 0: 0 means unbounded, as in DeepSpeed
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or cap // min(micro)
    if max(micro) > cap:
        per_node = "" if cap == config.max_train_batch_size else (
            f" / (num_gpus_per_node {config.num_gpus_per_node} / model_parallel_size {config.model_parallel_size})"
            f" = {cap}, the cap per node")
        raise ElasticityConfigError(f"{path}.micro_batch_sizes",
                                    f"{list(micro)} has a micro batch above {path}.max_train_batch_size "
                                    f"{config.max_train_batch_size}{per_node}; every micro batch must fit in it")
    bases = set(micro) | {math.lcm(*micro)}
    # a base above the cap (only the lcm can be) is dropped: scaling it could only grow it
    candidates = {max(h for h in _HIGHLY_COMPOSITE if h <= cap // base) * base for base in bases if base <= cap}
    counts = {batch: _valid_counts(batch, micro, min_gpus, max_gpus) for batch in candidates}

    def rank(batch: int) -> tuple[int, int]:  # most counts first, then the preferred end of the batch sizes
        return len(counts[batch]), batch if config.prefer_larger_batch else -batch

    best = max(candidates, key=rank)
    # DeepSpeed starts its search from (no counts, the smallest micro batch) and keeps that when no candidate beats it
    smallest = min(micro)
    if rank(best) <= (0, smallest if config.prefer_larger_batch else -smallest):
        return smallest, None
    return best, counts[best]


def _plan_v02(config: ElasticityConfig, gpus: int, path: str) -> tuple[int, tuple[int, ...], int | None]:
    per_node, mp = config.num_gpus_per_node, config.model_parallel_size
    if per_node % mp:
        raise ElasticityError(f"{path}.num_gpus_per_node", f"{per_node} is not divisible by {path}."
                                                           f"model_parallel_size {mp}")
    dp_per_node = per_node // mp
    node_batch, node_counts = _plan_v01(config, config.max_train_batch_size // dp_per_node,
                                        config.min_gpus // per_node, config.max_gpus // per_node, path)
    if node_counts is None:  # DeepSpeed fails here with a TypeError
        raise ElasticityConfigError(f"{path}.min_gpus", f"no node count between {path}.min_gpus {config.min_gpus} "
                                                        f"and {path}.max_gpus {config.max_gpus} ({per_node} GPUs per "
                                                        f"node) fits any candidate batch size")
    batch = node_batch * dp_per_node
    valid = tuple(n * dp_per_node for n in node_counts)
    if gpus // mp in valid:
        return batch, valid, _candidate_micro(config, batch, gpus)
    # Not a planned count: a batch for this world size alone. DeepSpeed computes it in floating point (the world
    # need not be a whole number of nodes), and so does this, so the same inputs give the same batch.
    dp = gpus / per_node * dp_per_node
    sizes = [math.floor(config.max_train_batch_size / float(m * dp)) * (m * dp) for m in config.micro_batch_sizes]
    fallback = max(sizes) if config.prefer_larger_batch else min(sizes)
    return int(fallback), (int(dp),), _candidate_micro(config, fallback, gpus)


def _candidate_micro(config: ElasticityConfig, batch: float, gpus: int) -> int | None:
    """Version 0.2's micro batch for ``gpus``: the largest that divides the share per GPU, or with
    ``prefer_larger_batch`` false the first such in the list as given."""
    fitting = [m for m in config.micro_batch_sizes if batch // gpus % m == 0]
    if not fitting:
        return None
    return max(fitting) if config.prefer_larger_batch else fitting[0]


def _valid_counts(batch: int, micro: tuple[int, ...], min_gpus: int, max_gpus: int) -> tuple[int, ...]:
    """The GPU counts in ``[min_gpus, max_gpus]`` that split ``batch`` into whole micro batches of one size."""
    found: set[int] = set()
    for m in micro:
        if batch % m:
            continue
        steps = batch // m  # micro batches per global batch: any divisor of it is a GPU count
        found.update(n for n in range(min_gpus, min(max_gpus, steps) + 1) if steps % n == 0)
    return tuple(sorted(found))


def _check_target_version(target: str) -> None:
    from packaging.version import InvalidVersion, Version  # transformers' dependency; only a scheduler asks this

    try:
        too_old = Version(target) < Version(MINIMUM_DEEPSPEED_VERSION)
    except InvalidVersion:
        raise ElasticityError("", f"target DeepSpeed version {target!r} is not a version number") from None
    if too_old:
        raise ElasticityError("", f"target DeepSpeed version {target} has no elasticity (it arrived in "
                                  f"{MINIMUM_DEEPSPEED_VERSION})")


# ---- reading the section's values ----------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(section: Mapping[str, Any], key: str, default: int, path: str, minimum: int | None = None) -> int:
    value = section.get(key, default)
    if not _is_int(value):
        raise ElasticityConfigError(f"{path}.{key}", f"{value!r}: must be an integer")
    if minimum is not None and value < minimum:
        raise ElasticityConfigError(f"{path}.{key}", f"{value}: must be >= {minimum}")
    return value


def _number(section: Mapping[str, Any], key: str, default: float, path: str) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ElasticityConfigError(f"{path}.{key}", f"{value!r}: must be a number >= 0")
    return value


def _bool(section: Mapping[str, Any], key: str, default: bool, path: str) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise ElasticityConfigError(f"{path}.{key}", f"{value!r}: must be true or false")
    return value


def _version(section: Mapping[str, Any], path: str) -> float:
    value = section.get("version", LATEST_VERSION)
    try:  # DeepSpeed reads it with float(), so "0.2" is 0.2 too
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise ElasticityConfigError(f"{path}.version", f"{value!r}: must be 0.1 or 0.2") from None


def _show(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)
