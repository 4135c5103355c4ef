"""Batch-size arithmetic: train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world.

Any two of the three determine the third. With fewer, DeepSpeed's defaults fill in: accumulation steps 1, then
micro batch 1. A contradiction or a derivation that does not divide evenly is a :class:`ConfigError` that shows
the arithmetic and says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["BATCH_KEYS", "BatchSizes", "resolve_batch"]

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH_KEYS = (TBS, MICRO, GAS)


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    derived: frozenset[str]  # computed from the others
    defaulted: frozenset[str]  # not given and not computable: DeepSpeed's default (1) used
    elastic: bool = False  # all three from the elasticity section's plan (config/elasticity.py)


def resolve_batch(train_batch_size: int | None, micro_batch: int | None, grad_accum: int | None,
                  world_size: int) -> BatchSizes:
    """The three batch keys for ``world_size`` ranks; ``None`` means not given."""
    tbs, micro, gas, world = train_batch_size, micro_batch, grad_accum, world_size
    derived: set[str] = set()
    defaulted: set[str] = set()
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world:
            raise ConfigError(TBS, f"{TBS} {tbs} != {MICRO} {micro} * {GAS} {gas} * world_size {world}; change one "
                                   f"of them (for this world size {TBS} would be {micro * gas * world}), or leave "
                                   f"{TBS} out so it is derived")
    elif tbs is not None and micro is not None:
        gas = _divide(tbs, micro, MICRO, world, GAS)
        derived.add(GAS)
    elif tbs is not None and gas is not None:
        micro = _divide(tbs, gas, GAS, world, MICRO)
        derived.add(MICRO)
    elif micro is not None and gas is not None:
        tbs = micro * gas * world
        derived.add(TBS)
    elif tbs is not None:
        gas = 1
        defaulted.add(GAS)
        if tbs % world:
            raise ConfigError(TBS, f"{TBS} {tbs} is not divisible by world_size {world}, so {MICRO} cannot be "
                                   f"derived; make {TBS} a multiple of {world}, or give {MICRO} and {GAS}")
        micro = tbs // world
        derived.add(MICRO)
    else:
        if micro is None:
            micro = 1
            defaulted.add(MICRO)
        if gas is None:
            gas = 1
            defaulted.add(GAS)
        tbs = micro * gas * world
        derived.add(TBS)
    return BatchSizes(tbs, micro, gas, frozenset(derived), frozenset(defaulted))


def _divide(tbs: int, given: int, given_key: str, world: int, wanted_key: str) -> int:
    divisor = given * world
    if tbs % divisor:
        raise ConfigError(TBS, f"{TBS} {tbs} is not divisible by {given_key} {given} * world_size {world} = "
                               f"{divisor}, so {wanted_key} cannot be derived; make {TBS} a multiple of {divisor}, "
                               f"or change {given_key}")
    return tbs // divisor
