"""Selecting modules by name pattern, the way DeepSpeed configs do (``re.search`` on the full module name)."""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Iterator

from torch import nn

from hf_zero.config.errors import ConfigError

if TYPE_CHECKING:
    from .config import Group


__all__ = ["linear_names", "match_group", "find_related", "blamed_on"]


@contextlib.contextmanager
def blamed_on(group: Group, name: str) -> Iterator[None]:
    """A ValueError raised while attaching a transform to module ``name`` (e.g. two methods claiming the same
    weight) becomes a ConfigError naming the group's ``modules`` key, which is what the user can change."""
    try:
        yield
    except ValueError as err:
        raise ConfigError(f"{group.path}.modules", f"{name}: {err}") from None


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]


def _matches(pattern: str, name: str) -> bool:
    return pattern == "*" or re.search(pattern, name) is not None


def match_group(model: nn.Module, group: Group, excluded: tuple[str, ...] = ()) -> list[str]:
    """Names of the nn.Linear modules ``group.modules`` selects; a pattern that selects nothing is an error."""
    names = linear_names(model)
    picked: list[str] = []
    for i, pattern in enumerate(group.modules):
        hits = [n for n in names if _matches(pattern, n) and not any(_matches(e, n) for e in excluded)]
        if not hits:
            sample = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ConfigError(f"{group.path}.modules[{i}]",
                              f"pattern {pattern!r} matches no torch.nn.Linear in {type(model).__name__} "
                              f"(linear modules are named like: {sample})")
        picked.extend(h for h in hits if h not in picked)
    return picked


def find_related(model: nn.Module, name: str, patterns: tuple[str, ...], group: Group) -> list[str]:
    """For module ``name`` and each related pattern, the one linear module that matches the pattern and sits in
    the closest enclosing scope (``model.layers.3.mlp.up_proj`` -> its own layer's ``down_proj``)."""
    names = linear_names(model)
    out: list[str] = []
    for i, pattern in enumerate(patterns):
        scope = name
        found = None
        while scope:
            scope = scope.rpartition(".")[0]
            prefix = scope + "." if scope else ""
            hits = [n for n in names if n.startswith(prefix) and n != name and _matches(pattern, n)]
            if len(hits) == 1:
                found = hits[0]
                break
            if len(hits) > 1:
                break
        if found is None:
            raise ConfigError(f"{group.path}.related_modules",
                              f"pattern {pattern!r} (item {i}) finds no single torch.nn.Linear next to {name}; "
                              f"name the one module in the same layer whose input shrinks with it")
        out.append(found)
    return out
