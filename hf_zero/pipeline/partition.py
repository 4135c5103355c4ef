"""Cutting a list of layers into contiguous parts: by count, or balancing per-layer weights."""

from __future__ import annotations

import re
from typing import Sequence

__all__ = ["partition_uniform", "partition_balanced", "partition_by_method"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries ``[0, ..., num_items]`` of ``num_parts`` parts whose sizes differ by at most one (larger last)."""
    if num_items < num_parts:
        raise ValueError(f"cannot cut {num_items} layers into {num_parts} pipeline parts: every part needs a layer")
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for i in range(num_parts):
        parts.append(parts[-1] + base + (1 if i >= num_parts - extra else 0))
    return parts


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` non-empty contiguous parts minimising the heaviest part's weight.

    Exact (dynamic programming over cut points); among equally heavy cuts the one closest to uniform is taken, so
    weight-0 layers (callables, norms under ``type:``) spread evenly instead of piling onto one stage.
    """
    n = len(weights)
    if n < num_parts:
        raise ValueError(f"cannot cut {n} layers into {num_parts} pipeline parts: every part needs a layer")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    uniform = partition_uniform(n, num_parts)
    inf = float("inf")
    # best[k][i]: (max part weight, distance from uniform) cutting the first i layers into k parts
    best = [[(inf, inf)] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev[0] == inf:
                    continue
                cand = (max(prev[0], prefix[i] - prefix[j]), prev[1] + abs(i - uniform[k]))
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    parts = [n]
    for k in range(num_parts, 0, -1):
        parts.append(cut[k][parts[-1]])
    return parts[::-1]


def partition_by_method(method: str, num_parts: int, *, num_layers: int, param_counts: Sequence[int],
                        class_names: Sequence[str]) -> list[int]:
    """DeepSpeed's ``partition_method``: ``uniform``, ``parameters`` or ``type:<regex>`` (case-insensitive)."""
    low = method.lower()
    if low == "uniform":
        return partition_uniform(num_layers, num_parts)
    if low == "parameters":
        return partition_balanced(param_counts, num_parts)
    if low.startswith("type:"):
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        weights = [1 if pattern.search(name) else 0 for name in class_names]
        if not any(weights):
            raise ValueError(f"partition_method={method!r} matches no layer class (classes: "
                             f"{sorted(set(class_names))})")
        return partition_balanced(weights, num_parts)
    if low == "profile":
        raise NotImplementedError("partition_method='profile' is not implemented (nor in DeepSpeed); use "
                                  "'parameters', 'uniform' or 'type:<regex>'")
    raise ValueError(f"unknown partition_method {method!r}; use 'parameters', 'uniform' or 'type:<regex>'")
