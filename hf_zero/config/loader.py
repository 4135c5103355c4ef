"""``load_config``: a DeepSpeed config (dict, JSON file or base64 JSON) -> a validated, resolved ``HfZeroConfig``.

Order matters for the error a user sees first:
1. read the source;
2. fill ``"auto"`` values from ``auto_values``;
3. parse strictly (unknown keys, types, values) -- a typo is reported before anything else;
4. any ``"auto"`` still unfilled is an error naming where its value could come from;
5. batch arithmetic for ``world_size`` -- or, with ``elasticity`` enabled, the elastic plan's batch sizes for it
   (:mod:`.elasticity`);
6. build ``cfg.raw``: the user's dict with typed values, autos filled, batch keys and
   ``zero_optimization.stage`` present (transformers and accelerate read ``engine.config`` from it);
7. keys hf_zero does not honour (:mod:`.status`): an error for a refused one, a warning for the others;
8. on rank 0, the startup table, and once per process a note when ``gradient_clipping`` is absent (it clips at 1.0).
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import functools
import json
import logging
import math
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from .auto import auto_paths, fill_autos, unresolved_auto_error
from .batch import BATCH_KEYS, BatchSizes, resolve_batch
from .elasticity import DEEPSPEED_ELASTICITY_CONFIG, apply_elasticity, parse_elasticity, scheduler_section
from .errors import ConfigError
from .hf_zero_config import HfZeroConfig
from .schema import Auto, json_fields, json_key, parse, to_dict
from .status import enforce
from .table import format_config_table

__all__ = ["load_config", "read_config"]

logger = logging.getLogger("hf_zero")


def load_config(config: Mapping[str, Any] | str | os.PathLike, *, world_size: int,
                auto_values: Mapping[str, Any] | None = None, rank: int = 0, log: bool = True,
                unresolved_auto: Literal["error", "default"] = "error") -> HfZeroConfig:
    """Validate and resolve a DeepSpeed-format config for ``world_size`` data-parallel ranks.

    ``config`` is a dict, a path to a JSON file, or base64-encoded JSON. ``auto_values`` maps dotted keys
    (``"optimizer.params.lr"``, ``"zero_optimization.reduce_bucket_size"``) to the values that replace ``"auto"``
    there. On ``rank`` 0 with ``log``, the resolved values that differ from the defaults are logged as one table.
    Raises :class:`ConfigError` for anything wrong, naming the key.

    ``unresolved_auto="default"`` is for reading a config before the HF integration has filled it (``zero.Init``
    inside ``from_pretrained``): an ``"auto"`` with no value takes the key's default, as DeepSpeed does there,
    except inside ``optimizer.params`` / ``scheduler.params``, where it stays :data:`AUTO` (nothing is built from
    those at that time). Such keys are marked ``"auto, default"`` / ``"auto, unresolved"`` in ``cfg.sources``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if unresolved_auto not in ("error", "default"):
        raise ValueError(f"unresolved_auto must be 'error' or 'default', got {unresolved_auto!r}")
    user = read_config(config)
    resolved, filled = fill_autos(user, auto_values or {})
    autos = [path for path in auto_paths(resolved)
             if path.split(".", 1)[0] not in _RAW_SECTIONS and path not in _AUTO_IS_A_VALUE]
    defaulted_autos: list[str] = []
    if unresolved_auto == "default":
        defaulted_autos = [path for path in autos if not path.startswith(_KEEP_AUTO)]
        resolved = _without(resolved, defaulted_autos)
    try:
        parsed: HfZeroConfig = parse(HfZeroConfig, _legacy_forms(resolved))
    except ConfigError as err:
        if err.key_path in filled:
            raise ConfigError(err.key_path, f"{err.detail} (this value replaced 'auto'; it came from auto_values)") \
                from None
        raise

    leftover = [path for path in autos if path not in BATCH_KEYS and path not in defaulted_autos]
    if leftover and unresolved_auto == "error":
        raise unresolved_auto_error(leftover)

    given = {key: getattr(parsed, key) for key in BATCH_KEYS}
    batch = _elastic_batch(parsed, resolved, world_size, warn=rank == 0, log=log and rank == 0)
    if batch is None:
        batch = resolve_batch(*(None if isinstance(given[key], Auto) else given[key] for key in BATCH_KEYS),
                              world_size=world_size)
    unfillable = [key for key in BATCH_KEYS if isinstance(given[key], Auto) and key in batch.defaulted]
    if unfillable:
        raise unresolved_auto_error(unfillable)

    sources = {path: "auto" for path in filled}
    sources.update({path: "auto, default" for path in defaulted_autos})
    sources.update({path: "auto, unresolved" for path in leftover})
    for key in BATCH_KEYS:
        was_auto = isinstance(given[key], Auto) or key in defaulted_autos
        if batch.elastic:
            sources[key] = "elasticity"
        elif key in batch.derived:
            sources[key] = "auto, derived" if was_auto else "derived"
        elif key in batch.defaulted:
            sources[key] = "auto, default" if was_auto else "default"
    values = {key: getattr(batch, key) for key in BATCH_KEYS}
    cfg = dataclasses.replace(parsed, **values, world_size=world_size, sources=sources)
    if cfg.data_parallel_size is not None and cfg.data_parallel_size != world_size:
        raise ConfigError("data_parallel_size", f"{cfg.data_parallel_size}, but {world_size} ranks train data-parallel "
                                                "here; hf_zero shards over every rank. Set it to the world size (or "
                                                "remove it); to split the model over ranks see "
                                                "hf_zero.tensor_parallel (apply_tp) and hf_zero.pipe")
    raw = _normalise(resolved, cfg)
    raw.update(values)
    zero_raw = raw.setdefault("zero_optimization", {})
    zero_raw["stage"] = cfg.zero.stage
    # Refused keys raise here; keys set but not honoured warn once (rank 0) and are listed in the table.
    cfg = dataclasses.replace(cfg, raw=raw)
    cfg = dataclasses.replace(cfg, not_implemented=enforce(cfg, warn=rank == 0))
    if log and rank == 0:
        logger.info("%s", format_config_table(cfg))
        if "gradient_clipping" not in resolved:
            _note_default_clipping(cfg.gradient_clipping)
    return cfg


def _elastic_batch(parsed: HfZeroConfig, resolved: Mapping[str, Any], world_size: int, *, warn: bool,
                   log: bool) -> BatchSizes | None:
    """The elastic plan's batch sizes for ``world_size`` when the ``elasticity`` section is enabled, else None.

    As DeepSpeed: batch keys beside an enabled section are an error unless ``ignore_non_elastic_batch_info``, then
    they are overridden (a warning names each); a scheduler's copy of the section in ``DEEPSPEED_ELASTICITY_CONFIG``
    must agree with it."""
    if parsed.elasticity is None:
        return None
    elastic = parse_elasticity(parsed.elasticity)
    if not elastic.enabled:
        return None
    set_keys = {key: resolved[key] for key in BATCH_KEYS if key in resolved}
    plan = apply_elasticity(elastic, world_size, set_keys,
                            scheduler_section=scheduler_section(os.environ.get(DEEPSPEED_ELASTICITY_CONFIG)))
    values = (plan.train_batch_size, plan.micro_batch_size, plan.gradient_accumulation_steps)
    if warn:
        for key, value in zip(BATCH_KEYS, values):
            if key in set_keys and set_keys[key] != value:
                logger.warning("elasticity: %s %r overridden by the elastic plan: %s", key, set_keys[key], value)
    if log:
        logger.info("elasticity: train_batch_size %d, train_micro_batch_size_per_gpu %d, "
                    "gradient_accumulation_steps %d on world size %d; valid GPU counts: %s", *values, world_size,
                    list(plan.valid_gpus))
    return BatchSizes(*values, derived=frozenset(), defaulted=frozenset(), elastic=True)


@functools.cache
def _note_default_clipping(max_norm: float) -> None:
    """Once per process: a config without ``gradient_clipping`` clips, as in DeepSpeed, which surprises users of
    DeepSpeed releases or trainers where an absent key meant no clipping."""
    logger.info("gradient_clipping is not set: clipping the global gradient norm at %s, DeepSpeed's default "
                "(GRADIENT_CLIPPING_DEFAULT). Set \"gradient_clipping\": 0.0 to train without clipping.", max_norm)


_KEEP_AUTO = ("optimizer.params.", "scheduler.params.")
# Keys where "auto" is a setting with its own meaning, not a value for the HF integration to fill in.
_AUTO_IS_A_VALUE = frozenset({"data_types.keep_in_fp32_modules",
                              # ZenFlow's "auto" is a mode of its own (hf_zero/zero/zenflow.py), nothing fills it
                              "zero_optimization.zenflow.select_strategy", "zero_optimization.zenflow.select_interval",
                              "zero_optimization.zenflow.update_interval"})
# Sections kept as given (pipeline, compression_training, ...): their "auto" values are their own business
# (DeepSpeed's pipeline.stages defaults to "auto"), not values for load_config to fill.
_RAW_SECTIONS = frozenset(
    json_key(f) for f in json_fields(HfZeroConfig)
    if any(typing.get_origin(arm) is Mapping for arm in typing.get_args(typing.get_type_hints(HfZeroConfig)[f.name])))


def _without(tree: Mapping[str, Any], paths: list[str]) -> dict[str, Any]:
    """A copy of ``tree`` without the leaves at the dotted ``paths``."""
    out = copy.deepcopy(dict(tree))
    for path in paths:
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node[part]
        del node[leaf]
    return out


def read_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The config as a fresh dict, from a dict, a JSON file path, or base64-encoded JSON (as DeepSpeed accepts)."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, os.PathLike):
        path = Path(config)
        if not path.is_file():
            raise ConfigError("", f"config file not found: {path}")
        return _read_file(path)
    if isinstance(config, str):
        if os.path.isfile(config):
            return _read_file(Path(config))
        decoded = _decode_base64_json(config)
        if decoded is not None:
            return decoded
        shown = config if len(config) <= 120 else config[:117] + "..."
        raise ConfigError("", f"config {shown!r} is neither an existing file (no such file: "
                              f"{os.path.abspath(config) if len(config) <= 4096 else shown}) nor base64-encoded JSON")
    raise ConfigError("", f"config must be a dict, a path to a JSON file or base64-encoded JSON, "
                          f"got {type(config).__name__}")


def _read_file(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = _parse(f.read(), f"config file {path}")
    if not isinstance(data, dict):
        raise ConfigError("", f"config file {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _parse(text: str, what: str) -> Any:
    """JSON, else hjson: DeepSpeed reads config files and base64 configs with hjson (comments, trailing commas,
    unquoted keys and strings), so configs written for it use them. A key given twice in one object is refused, as
    DeepSpeed refuses it (json would keep the last one silently)."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as err:
        json_error = f"{err.msg} at line {err.lineno} column {err.colno}"
    try:
        import hjson  # a dependency (DeepSpeed's too), imported only for a config that is not plain JSON
    except ImportError:
        raise ConfigError("", f"{what} is not valid JSON ({json_error}); DeepSpeed would read it as hjson, which "
                              "is not installed here (pip install hjson)") from None
    try:
        return hjson.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except hjson.HjsonDecodeError:
        raise ConfigError("", f"{what} is neither valid JSON ({json_error}) nor hjson") from None


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(str(key), "given twice in the same object of the config; keep one")
        out[key] = value
    return out


def _decode_base64_json(text: str) -> dict[str, Any] | None:
    try:
        decoded = base64.urlsafe_b64decode(text.strip()).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    try:
        data = _parse(decoded, "the base64-encoded config")
    except ConfigError as err:
        if err.key_path:  # valid syntax with a key given twice: that is the user's error to see
            raise
        return None
    return data if isinstance(data, dict) else None


def _legacy_forms(tree: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's older spellings, rewritten for parsing only (``cfg.raw`` keeps the user's form)."""
    out = dict(tree)
    zero = out.get("zero_optimization")
    if isinstance(zero, bool):  # "zero_optimization": true meant stage 1
        out["zero_optimization"] = {"stage": 1 if zero else 0}
    steps = out.get("steps_per_print")
    if isinstance(steps, float) and math.isinf(steps) and steps > 0:  # the HF Trainer passes Infinity
        out["steps_per_print"] = None
    return out


def _normalise(tree: Mapping[str, Any], obj: Any) -> dict[str, Any]:
    """``tree`` (the user's keys) with each value replaced by its typed, JSON form from ``obj``."""
    by_key: dict[str, dataclasses.Field] = {}
    for f in json_fields(type(obj)):
        by_key[json_key(f)] = f
        for alias in f.metadata.get("aliases", ()):
            by_key[alias] = f
    out: dict[str, Any] = {}
    for key, value in tree.items():
        f = by_key.get(key)
        if f is None:  # a key parsing let through unread (an unknown top-level key, an option switched off)
            out[key] = copy.deepcopy(value)
            continue
        typed = getattr(obj, f.name)
        if dataclasses.is_dataclass(typed) and isinstance(value, Mapping):
            out[key] = _normalise(value, typed)
        elif typed is None:
            out[key] = copy.deepcopy(value)  # e.g. steps_per_print Infinity
        else:
            out[key] = to_dict(typed)
    return out
