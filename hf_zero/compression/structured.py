"""Helpers shared by the structured pruning methods: config sizes and consistency of what a method removes."""

from __future__ import annotations

import warnings

from torch import nn

__all__ = ["uniform_count", "config_of", "check_keeps_some"]


def config_of(model: nn.Module):
    return getattr(model, "config", None)


def uniform_count(counts: dict[str, int], what: str) -> int | None:
    """The one kept count shared by every pruned module, or None (with a warning) when layers differ -- a
    transformers config holds one size for all layers, so such a model cannot be rebuilt by from_pretrained.
    None, silently, when nothing was pruned: there is no size to set."""
    if not counts:
        return None
    values = set(counts.values())
    if len(values) == 1:
        return values.pop()
    warnings.warn(f"{what} differs between layers ({counts}); the cleaned model works, but its transformers "
                  f"config cannot describe it, so from_pretrained will not rebuild it", stacklevel=3)
    return None


def check_keeps_some(group, units: int, what: str) -> None:
    """A dense_ratio that would keep no unit of a module is impossible: name the key and the smallest ratio."""
    from hf_zero.config.errors import ConfigError

    ratio = group.params.dense_ratio
    if round(ratio * units) < 1:
        raise ConfigError(f"{group.path}.params.dense_ratio",
                          f"{ratio} of {units} {what} keeps none; the smallest ratio that keeps one is "
                          f"{1 / units:.4g}")
