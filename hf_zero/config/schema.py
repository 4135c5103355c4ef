"""Strict parsing of plain dicts (JSON) into frozen, typed dataclasses.

Every config section in hf_zero is a ``@dataclass(frozen=True, kw_only=True)`` whose fields carry their type,
their default and, in ``field(metadata=...)``, a help text and optional DeepSpeed aliases. :func:`parse` walks
a JSON dict against such a class once, at the edge, and either returns the typed object or raises
:class:`ConfigError` naming the full key path. Nothing downstream ever sees the raw dict.

Conversions users expect are done here and only here: ``"8"`` -> ``8`` for an int field, ``2e8`` -> ``200000000``
when the float is integral, a JSON list -> tuple. Anything else of the wrong type is an error.

A section class may name DeepSpeed keys it knowingly rejects in a ``_unsupported_keys: ClassVar[dict[str, str]]``
(key -> what the option is), so the user reads "not supported, remove it" rather than a typo suggestion.
Unknown top-level keys warn and are ignored, as DeepSpeed's training config ignores them; a root class that sets
``_strict_keys: ClassVar[bool] = True`` refuses them like any other unknown key (DeepSpeed's inference config).
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any, Literal, Union

from .boolean import as_bool, truthy
from .errors import ConfigError, closest
from .status import ConfigKeyIgnored

__all__ = ["AUTO", "Auto", "parse", "doc", "json_fields", "json_key", "known_keys", "to_dict", "spec"]


class Auto:
    """Marker for a value the user left as ``"auto"``: filled later from TrainingArguments, the model, the world."""

    _instance: "Auto | None" = None

    def __new__(cls) -> "Auto":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "'auto'"

    def __reduce__(self):  # keep the singleton through pickling / deepcopy
        return (Auto, ())


AUTO = Auto()


def spec(default: Any = dataclasses.MISSING, *, help: str, aliases: tuple[str, ...] = (), auto: bool = False,
         default_factory: Any = dataclasses.MISSING, key: str | None = None, json: bool = True, **extra: Any) -> Any:
    """A dataclass field with its help text. ``auto=True`` lets the user write ``"auto"`` for it.

    ``key`` is the JSON key when it differs from the attribute name (``zero`` is read from ``zero_optimization``).
    ``json=False`` marks a field computed by the loader (``raw``, ``world_size``): it is never read from JSON.
    ``extra`` entries go into the field's metadata as they are, for the section's own code (parsing ignores them).
    """
    metadata = {"help": help, "aliases": aliases, "auto": auto, "key": key, "json": json, **extra}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def json_key(f: dataclasses.Field) -> str:
    """The JSON key of a field: its ``key`` override, else its attribute name."""
    return f.metadata.get("key") or f.name


def json_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are read from JSON (loader-computed ones left out)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("json", True)]


def known_keys(cls: type) -> list[str]:
    """Every JSON key a section accepts, aliases included."""
    keys = []
    for f in json_fields(cls):
        keys.append(json_key(f))
        keys.extend(f.metadata.get("aliases", ()))
    return keys


def primary_keys(cls: type, section: Any) -> dict[str, Any]:
    """A raw section of ``cls`` with each alias renamed to the key it stands for (other keys kept as they are): for
    code that reads ``cfg.raw`` or a config file by key."""
    primary = {alias: json_key(f) for f in json_fields(cls) for alias in f.metadata.get("aliases", ())}
    return {primary.get(k, k): v for k, v in (section or {}).items()} if isinstance(section, Mapping) else {}


def doc(cls: type) -> dict[str, str]:
    """key -> help text, for documentation and ``hf-zero doctor``."""
    return {json_key(f): f.metadata.get("help", "") for f in json_fields(cls)}


def _switched_off(raw: Any) -> bool:
    """An option section that asks for nothing: false/null, or every on-switch in it false (``enabled``,
    ``deepcompile``). An empty section is not off: it asks for the feature with its defaults."""
    if raw is None or as_bool(raw) is False:
        return True
    if isinstance(raw, Mapping):
        switches = [raw[k] for k in ("enabled", "deepcompile") if k in raw]
        return bool(switches) and not any(truthy(s) for s in switches)
    return False


def parse(cls: type, value: Any, path: str = "") -> Any:
    """Parse ``value`` (a JSON object) into an instance of the dataclass ``cls``; ``path`` prefixes error keys."""
    if isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"expected a JSON object (section {cls.__name__}), got {_show(value)}")
    by_name: dict[str, dataclasses.Field] = {}
    for f in json_fields(cls):
        by_name[json_key(f)] = f
        for alias in f.metadata.get("aliases", ()):
            by_name[alias] = f
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, raw in value.items():
        key_path = f"{path}.{key}" if path else str(key)
        f = by_name.get(key)
        if f is None and key in getattr(cls, "_unsupported_keys", {}):
            if _switched_off(raw):  # e.g. DeepSpeed-Chat's "hybrid_engine": {"enabled": false}: nothing to run
                continue
            raise ConfigError(key_path, f"{cls._unsupported_keys[key]} is a DeepSpeed option hf_zero does not support; "
                                        "remove it from the config (or switch it off)")
        if f is None:
            guess = closest(str(key), by_name)
            hint = f"; did you mean '{guess}'?" if guess else f"; accepted keys: {', '.join(sorted(by_name))}"
            if not path and not getattr(cls, "_strict_keys", False):
                # DeepSpeed ignores top-level keys it does not know (only its sections refuse extra keys), so
                # configs carry such keys: accepted, with a warning naming the key (a typo shows up here)
                warnings.warn(f"hf_zero: config key '{key}' is unknown{hint}; ignored, as DeepSpeed ignores unknown "
                              "top-level keys", ConfigKeyIgnored, stacklevel=2)
                continue
            if getattr(cls, "_ignores_unknown_keys", False):
                # a section DeepSpeed still reads key by key (its DeepSpeedConfigObject ones: flops_profiler,
                # activation_checkpointing), where an unknown key is ignored rather than refused
                warnings.warn(f"hf_zero: config key '{key_path}' is unknown{hint}; ignored, as DeepSpeed ignores "
                              f"unknown keys in this section", ConfigKeyIgnored, stacklevel=2)
                continue
            raise ConfigError(key_path, f"unknown key{hint}")
        if f.name in kwargs:
            raise ConfigError(key_path, f"given twice (as '{json_key(f)}' and one of its aliases); keep one")
        if raw == "auto":
            if not f.metadata.get("auto"):
                raise ConfigError(key_path, "'auto' is not accepted for this key (nothing fills it in); write a value")
            kwargs[f.name] = AUTO
        else:
            kwargs[f.name] = _convert(hints[f.name], raw, key_path)
    for f in json_fields(cls):
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            key_path = f"{path}.{json_key(f)}" if path else json_key(f)
            raise ConfigError(key_path, f"required key missing ({f.metadata.get('help', '')})")
    try:
        return cls(**kwargs)
    except ConfigError as err:  # __post_init__ checks name their key relative to the section
        full = ".".join(p for p in (path, err.key_path) if p)
        raise ConfigError(full, err.detail) from None
    except (TypeError, ValueError) as err:
        raise ConfigError(path, str(err)) from err


def to_dict(obj: Any) -> Any:
    """The JSON form of a parsed section (AUTO becomes "auto"); inverse of :func:`parse`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {json_key(f): to_dict(getattr(obj, f.name)) for f in json_fields(type(obj))}
    if isinstance(obj, Auto):
        return "auto"
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _convert(tp: Any, raw: Any, key_path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None) and a is not Auto]  # "auto" is handled by parse()
        if len(arms) == 1:  # Optional[X]: X's own error, which may name a key deeper inside
            return _convert(arms[0], raw, key_path)
        errors = []
        for arm in arms:
            try:
                return _convert(arm, raw, key_path)
            except ConfigError as err:
                errors.append(err.detail)
        raise ConfigError(key_path, " or ".join(dict.fromkeys(errors)))
    if origin is Literal:
        for allowed in args:
            if isinstance(raw, bool) != isinstance(allowed, bool):  # true is not 1 here
                continue
            if raw == allowed or (isinstance(raw, str) and isinstance(allowed, str) and raw.lower() == allowed):
                return allowed
            if isinstance(raw, str) and isinstance(allowed, int) and raw.strip() == str(allowed):  # "2" -> 2
                return allowed
        accepted = ", ".join(repr(a) for a in args)
        raise ConfigError(key_path, f"value {_show(raw)} is not accepted; use one of {accepted}")
    if dataclasses.is_dataclass(tp):
        return parse(tp, raw, key_path)
    if origin in (tuple,):
        if not isinstance(raw, (list, tuple)):
            raise ConfigError(key_path, f"expected a list, got {_show(raw)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{key_path}[{i}]") for i, v in enumerate(raw))
        if len(raw) != len(args):
            raise ConfigError(key_path, f"expected a list of {len(args)} values, got {_show(raw)}")
        return tuple(_convert(a, v, f"{key_path}[{i}]") for i, (a, v) in enumerate(zip(args, raw)))
    if origin in (Mapping, dict) or tp in (dict, Mapping):
        if not isinstance(raw, Mapping):
            raise ConfigError(key_path, f"expected a JSON object, got {_show(raw)}")
        return types.MappingProxyType(dict(raw))
    if tp is Any:
        return raw
    if tp is bool:
        value = as_bool(raw)  # what DeepSpeed's config models also take for a boolean: 0 / 1 and the usual words
        if value is not None:
            return value
        raise ConfigError(key_path, f"expected true or false, got {_show(raw)}")
    if tp is int:
        if isinstance(raw, bool):
            raise ConfigError(key_path, f"expected an integer, got {_show(raw)}")
        if isinstance(raw, int):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if isinstance(raw, str):
            try:
                as_float = float(raw)
            except ValueError:
                pass
            else:
                if as_float.is_integer():
                    return int(as_float)
        raise ConfigError(key_path, f"expected an integer, got {_show(raw)}")
    if tp is float:
        if isinstance(raw, bool):
            raise ConfigError(key_path, f"expected a number, got {_show(raw)}")
        if isinstance(raw, (int, float)):
            return float(raw)
        if isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
        raise ConfigError(key_path, f"expected a number, got {_show(raw)}")
    if tp is str:
        if isinstance(raw, str):
            return raw
        raise ConfigError(key_path, f"expected a string, got {_show(raw)}")
    raise TypeError(f"hf_zero.config.schema cannot parse fields of type {tp!r} ({key_path})")
