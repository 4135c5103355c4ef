"""Small helpers every hf_zero package may use; it owns nothing of the training state.

Bottom layer: imports no other hf_zero package (the layer table is ``LAYERS`` in tests/test_layering.py), so any
package may import it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, table: dict[str, str], namespace: dict) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``package``: ``table`` maps a public name to the module defining it,
    imported on first access and then cached in ``namespace`` (the package's ``globals()``), so importing the
    package itself stays cheap (no torch.distributed, transformers or compiled ops until a name is used)."""

    def __getattr__(name: str) -> Any:
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(target), name)
        namespace[name] = value
        return value

    return __getattr__
