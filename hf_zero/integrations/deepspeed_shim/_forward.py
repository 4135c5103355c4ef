"""The two ways a module of the ``deepspeed`` shim tree points at hf_zero, so the tree itself holds no logic.

- :func:`forward` -- a DeepSpeed module whose names live under other names or in several hf_zero modules. The
  module gets a table ``name -> "hf_zero.module:attr"`` (or ``"some.module"`` for a module) and resolves a name
  on first access, not at import: ``import deepspeed`` must stay cheap (accelerate imports it on every
  ``unwrap_model``), and a target that is missing only fails the code that uses it.
- :func:`alias` -- a DeepSpeed module that corresponds one-to-one to an hf_zero module
  (``deepspeed.comm`` -> ``hf_zero.comm``): the shim module *is* the hf_zero module in ``sys.modules``, so reads,
  writes and ``mock.patch`` act on hf_zero itself (transformers temporarily replaces
  ``partition_parameters.zero_wrapper_for_fp_tensor_constructor`` and expects ``zero.Init`` to see that).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterable, Mapping

__all__ = ["forward", "alias"]


class _ForwardingModule(types.ModuleType):
    """A shim module whose missing attributes are looked up in its forwarding table."""

    def __getattr__(self, name: str):
        table = self.__dict__.get("_hf_zero_forward", {})
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (hf_zero's deepspeed "
                                 f"compatibility layer provides here: {', '.join(sorted(table))})")
        module_name, _, attr = target.partition(":")
        module = importlib.import_module(module_name)  # ImportError propagates: it names the missing module
        if not attr:
            value = module
        else:
            try:
                value = getattr(module, attr)
            except AttributeError:
                raise AttributeError(f"{self.__name__}.{name} forwards to {module_name}.{attr}, which this "
                                     f"version of hf_zero does not define") from None
        # Cache: later reads are plain attribute lookups. Names are only cached once resolved successfully.
        self.__dict__[name] = value
        return value

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self.__dict__.get("_hf_zero_forward", {})))


def forward(module_name: str, names: Mapping[str, str] = (), submodules: Iterable[str] = ()) -> None:
    """Make ``sys.modules[module_name]`` resolve ``names`` (``"pkg.mod:attr"`` or ``"pkg.mod"``) and the shim's own
    ``submodules`` lazily. Call it at the top of a shim module as ``forward(__name__, {...})``."""
    module = sys.modules[module_name]
    table = dict(names)
    for sub in submodules:
        table[sub] = f"{module_name}.{sub}"
    module.__class__ = _ForwardingModule
    module.__dict__["_hf_zero_forward"] = table
    module.__dict__["__all__"] = [name for name in table if not name.startswith("_")]


def alias(module_name: str, target: str) -> None:
    """Make the shim module ``module_name`` be the hf_zero module ``target`` from now on (``import`` of the shim
    returns the hf_zero module, because the import system hands back whatever ``sys.modules`` holds)."""
    sys.modules[module_name] = importlib.import_module(target)
