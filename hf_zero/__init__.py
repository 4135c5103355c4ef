"""hf_zero: a ZeRO training engine for the Hugging Face stack.

The public API mirrors DeepSpeed's (``hf_zero.initialize``, ``hf_zero.zero.Init``, ...). Submodules are imported
lazily so that ``import hf_zero`` -- which the ``deepspeed`` compatibility hook does in every Python process --
costs almost nothing until a name is actually used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it
_LAZY = {
    "initialize": "hf_zero.runtime.initialize",
    "HfZeroEngine": "hf_zero.runtime.engine",
    "ConfigError": "hf_zero.config.errors",
    "zero": "hf_zero.zero",
    "ops": "hf_zero.ops",
    "comm": "hf_zero.comm",
    "compression": "hf_zero.compression",
    "config": "hf_zero.config",
    "pipeline": "hf_zero.pipeline",
    "offload": "hf_zero.offload",
    "runtime": "hf_zero.runtime",
    "integrations": "hf_zero.integrations",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:
    from hf_zero.config.errors import ConfigError
    from hf_zero.runtime.engine import HfZeroEngine
    from hf_zero.runtime.initialize import initialize


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")
    module = importlib.import_module(target)
    value = module if target.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value
