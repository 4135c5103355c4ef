"""hf_zero: a ZeRO training engine for the Hugging Face stack.

The public API mirrors DeepSpeed's (``hf_zero.initialize``, ``hf_zero.zero.Init``, ...). Submodules are imported
lazily so that ``import hf_zero`` -- which the ``deepspeed`` compatibility hook does in every Python process --
costs almost nothing until a name is actually used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> (module that defines it, attribute of that module; None for the module itself)
_LAZY = {
    "initialize": ("hf_zero.runtime.initialize", "initialize"),
    "add_config_arguments": ("hf_zero.runtime.arguments", "add_config_arguments"),
    "HfZeroEngine": ("hf_zero.runtime.engine", "HfZeroEngine"),
    "ConfigError": ("hf_zero.config.errors", "ConfigError"),
    "init_distributed": ("hf_zero.comm", "init_distributed"),
    **{sub: (f"hf_zero.{sub}", None) for sub in ("zero", "ops", "comm", "compression", "config", "pipeline",
                                                 "offload", "runtime", "integrations")},
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:
    from hf_zero.runtime.arguments import add_config_arguments
    from hf_zero.config.errors import ConfigError
    from hf_zero.runtime.engine import HfZeroEngine
    from hf_zero.runtime.initialize import initialize


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
