"""The ``pipeline`` config section: DeepSpeed's keys plus hf_zero's ``schedule`` / ``virtual_stages``, read once.

DeepSpeed parses ``stages`` and ``partition`` but lets the ``PipelineModule`` constructor decide; hf_zero checks
that the two agree instead of letting one silently win. Every key either changes behaviour or is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hf_zero.config.errors import ConfigError

__all__ = ["PipelineConfig", "parse_pipeline_config"]

# schedules whose backward splits input and weight gradients (torch.autograd.grad with inputs=)
ZERO_BUBBLE = frozenset({"interleaved_zero_bubble"})

_KEYS = {"stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
         "grad_partitioned", "use_reentrant", "schedule", "virtual_stages"}


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "1f1b"
    virtual_stages: int | None = None      # None: the module's
    activation_checkpoint_interval: int | None = None
    stages: int | None = None              # None: "auto"
    partition: str | None = None           # None: DeepSpeed's "best" (the module decides)
    seed_layers: bool | None = None
    # DeepSpeed's: false checkpoints with non_reentrant_checkpoint, true with the module's function (reentrant by
    # default); None: the module's own choice (hf_zero's PipelineModule: torch's non-reentrant checkpoint)
    use_reentrant: bool | None = None


def _int(raw: Mapping, key: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"pipeline.{key}", f"must be a non-negative integer, got {value!r}")
    return value


def parse_pipeline_config(raw: Mapping[str, Any] | None, *, model_parallel_size: int = 1) -> PipelineConfig:
    raw = dict(raw or {})
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ConfigError(f"pipeline.{unknown[0]}", f"unknown key; the pipeline section takes {sorted(_KEYS)}")
    schedule = str(raw.get("schedule", "1f1b")).lower()
    stages = None
    if raw.get("stages", "auto") != "auto":
        stages = _int(raw, "stages")
    partition = raw.get("partition", "best")
    partition = None if partition in ("best", "auto") else str(partition)
    use_reentrant = raw.get("use_reentrant")
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise ConfigError("pipeline.use_reentrant", f"must be true or false, got {use_reentrant!r}")
    if use_reentrant and schedule in ZERO_BUBBLE:
        raise ConfigError("pipeline.use_reentrant", f"true cannot run under pipeline.schedule {schedule!r}: its "
                                                    "backward computes input and weight gradients separately with "
                                                    "torch.autograd.grad, which reentrant checkpointing does not "
                                                    "support; set it to false")
    for key in ("pipe_partitioned", "grad_partitioned"):
        # DeepSpeed: split the boundary activation / gradient across the tensor-parallel group; nothing to split
        # without tensor parallelism (its default true is a no-op there too)
        if raw.get(key) is True and model_parallel_size > 1:
            raise ConfigError(f"pipeline.{key}", "partitioning boundary tensors across tensor-parallel ranks is "
                                                 "not implemented; set it to false")
    seed_layers = raw.get("seed_layers")
    if seed_layers is not None and not isinstance(seed_layers, bool):
        raise ConfigError("pipeline.seed_layers", f"must be true or false, got {seed_layers!r}")
    return PipelineConfig(
        schedule=schedule,
        virtual_stages=_int(raw, "virtual_stages") if "virtual_stages" in raw else None,
        activation_checkpoint_interval=(_int(raw, "activation_checkpoint_interval")
                                        if "activation_checkpoint_interval" in raw else None),
        stages=stages, partition=partition, seed_layers=seed_layers, use_reentrant=use_reentrant)
