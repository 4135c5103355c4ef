"""The startup table: the resolved values that differ from the defaults, where each "auto" came from, which of
them hf_zero does not honour (:mod:`.status`), and the keys that were accepted but are not implemented yet."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .batch import BATCH_KEYS
from .hf_zero_config import HfZeroConfig
from .schema import to_dict
from .status import Status, not_honoured

__all__ = ["format_config_table", "flatten"]

_ALWAYS_SHOWN = (*BATCH_KEYS, "zero_optimization.stage")
_MISSING = object()


def format_config_table(cfg: HfZeroConfig) -> str:
    """One line per value that differs from the default (batch keys and ZeRO stage always), marked with its source."""
    current = flatten(to_dict(cfg))
    defaults = flatten(to_dict(HfZeroConfig()))
    ignored = {label: entry.status for label, entry in not_honoured(cfg)}
    rows = [(key, _show(value), _mark(key, cfg.sources.get(key), ignored))
            for key, value in current.items()
            if key in _ALWAYS_SHOWN or key in cfg.sources
            or defaults.get(key, _MISSING) not in (value, _MISSING)
            or (key not in defaults and value is not None)]  # a section off by default: its keys given, not None
    # The value column is capped so one long value (a list, a path) does not push every source mark right.
    width = max(len(key) for key, _, _ in rows)
    value_width = min(max(len(value) for _, value, _ in rows), 14)
    dtype = str(cfg.compute_dtype).removeprefix("torch.")
    lines = [f"hf_zero config: world_size {cfg.world_size}, ZeRO stage {cfg.zero.stage}, {dtype} "
             f"(values that differ from the defaults)"]
    lines += [f"  {key:<{width}}  {value:<{value_width}}  {mark}".rstrip() for key, value, mark in rows]
    if cfg.not_implemented:
        lines.append(f"  accepted, not yet implemented: {', '.join(cfg.not_implemented)}")
    return "\n".join(lines)


def _mark(key: str, source: str | None, ignored: dict[str, Status]) -> str:
    """``(auto)``, ``(no effect)``, ``(not implemented)`` or a combination; a section's status marks its keys."""
    marks = [source] if source else []
    for label, status in ignored.items():
        if key == label or key.startswith(label + "."):
            marks.append(status.value)
            break
    return f"({', '.join(marks)})" if marks else ""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (an empty mapping stays a value)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def _show(value: Any) -> str:
    return json.dumps(value, default=str)
