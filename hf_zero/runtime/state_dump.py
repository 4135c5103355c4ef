"""``dump_state``: after initialize, global rank 0 logs the engine's state and every resolved config value.

DeepSpeed logs each attribute of its engine (``print_configuration(engine, "DeepSpeedEngine")``, one
``  name ..... value`` line each, names sorted). hf_zero logs the same shape in two blocks: the engine's own
attributes (objects by their class name: a model or an optimizer's repr would run to pages), then every key of the
resolved config, defaults included -- the start-up table shows only the values that differ from the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_zero.config import HfZeroConfig
from hf_zero.config.schema import to_dict
from hf_zero.config.table import flatten

__all__ = ["format_engine_state"]

_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)


def format_engine_state(engine: torch.nn.Module, config: HfZeroConfig) -> str:
    """``HfZeroEngine state:`` and ``HfZeroEngine configuration:`` blocks, one ``  name ..... value`` line each."""
    name = type(engine).__name__
    state = {k: v for k, v in vars(engine).items() if not k.startswith("_")}
    state.update({k: m for k, m in engine.named_children()})  # nn.Module keeps the wrapped model in _modules
    values = flatten(to_dict(config))
    return "\n".join([f"{name} state:", *_block({k: _show(v) for k, v in state.items()}),
                      f"{name} configuration:", *_block({k: repr(v) for k, v in values.items()})])


def _block(rows: dict[str, str]) -> list[str]:
    """DeepSpeed's ``  name ..... value`` lines (dots to column 29), widened so the longest name keeps a dot."""
    width = max([29, *(len(key) + 1 for key in rows)])
    return [f"  {key} {'.' * (width - len(key))} {rows[key]}" for key in sorted(rows)]


def _show(value: Any) -> str:
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value) and len(value) <= 8:
        return repr(value)
    return f"<{type(value).__name__}>"
