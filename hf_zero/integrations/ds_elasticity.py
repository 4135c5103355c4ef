"""``deepspeed.elasticity``: DeepSpeed's elasticity functions, with its signatures and return values, over
:mod:`hf_zero.config.elasticity` (the plan itself, and the checks ``load_config`` applies at ``initialize``).

A resource scheduler or launcher calls ``compute_elastic_config(ds_config, target_deepspeed_version)`` to learn
which GPU counts a job may run on before it starts; the job then trains with the batch sizes the same plan gives for
its world size. These are the edge where DeepSpeed reads the environment (``WORLD_SIZE``,
``DEEPSPEED_ELASTICITY_CONFIG``); the plan underneath takes plain arguments.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hf_zero.config.elasticity import (DEEPSPEED_ELASTICITY_CONFIG, ELASTICITY, ElasticityConfigError,
                                       check_scheduler_config, elastic_plan, parse_elasticity, scheduler_section)

__all__ = ["ELASTICITY", "ENABLED", "ENABLED_DEFAULT", "compute_elastic_config", "elasticity_enabled",
           "ensure_immutable_elastic_config", "is_torch_elastic_compatible"]

logger = logging.getLogger("hf_zero")

ENABLED = "enabled"
ENABLED_DEFAULT = False


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple:
    """``(train_batch_size, valid_gpus)``; with ``world_size`` > 0 (checked against ``valid_gpus``) or
    ``return_microbatch``, ``(train_batch_size, valid_gpus, micro_batch_size)``.

    As DeepSpeed 0.19.7: version 0.2 without ``world_size`` plans for ``WORLD_SIZE``; version 0.1 with
    ``return_microbatch`` and no ``world_size`` picks the micro batch for ``WORLD_SIZE``.
    """
    if not isinstance(ds_config, dict):
        raise ValueError(f"ds_config must be a dict, got {type(ds_config).__name__}: {ds_config!r}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(ELASTICITY, "missing from the config; add an enabled elasticity section to plan "
                                                "an elastic job")
    section = ds_config[ELASTICITY]
    if isinstance(section, Mapping) and not section.get(ENABLED, ENABLED_DEFAULT):
        raise ElasticityConfigError(f"{ELASTICITY}.{ENABLED}", "false; set it true to plan an elastic job")
    config = parse_elasticity(section)
    given = world_size if world_size > 0 else None
    planning = _env_world_size() if given is None and config.version == 0.2 else None
    plan = elastic_plan(config, given, target_deepspeed_version=target_deepspeed_version,
                        planning_world_size=planning)
    valid = list(plan.valid_gpus)
    if given is not None or (return_microbatch and config.version == 0.2):
        return plan.train_batch_size, valid, plan.micro_batch_size
    if return_microbatch:
        env_world = _env_world_size()
        if env_world is None:
            raise ElasticityConfigError(f"{ELASTICITY}.version", f"{config.version}: the micro batch depends on the "
                                                                 f"world size; pass world_size or set WORLD_SIZE "
                                                                 f"(it is {os.environ.get('WORLD_SIZE')!r})")
        return plan.train_batch_size, valid, elastic_plan(config, env_world).micro_batch_size
    return plan.train_batch_size, valid


def elasticity_enabled(ds_config: dict) -> Any:
    """The section's ``enabled`` value (False without the section)."""
    if ELASTICITY not in ds_config:
        return False
    return ds_config[ELASTICITY].get(ENABLED, ENABLED_DEFAULT)


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict) -> None:
    """Refuse a section that differs, in a key the plan depends on, from the scheduler's copy in
    ``DEEPSPEED_ELASTICITY_CONFIG``; without that variable, warn that nothing can be checked (as DeepSpeed)."""
    scheduled = scheduler_section(os.environ.get(DEEPSPEED_ELASTICITY_CONFIG))
    if scheduled is None:
        logger.warning("%s is not set, so hf_zero cannot check that the resource scheduler sizes this job with the "
                       "same elasticity section", DEEPSPEED_ELASTICITY_CONFIG)
        return
    check_scheduler_config(parse_elasticity(runtime_elastic_config_dict), scheduled)


def is_torch_elastic_compatible() -> bool:
    """DeepSpeed asks for torch >= 1.11 (torch.distributed.elastic); hf_zero needs torch >= 2.11."""
    return True


def _env_world_size() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value is not None and value.isdecimal() and int(value) > 0 else None
