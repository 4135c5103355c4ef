"""Small validation helpers shared by the per-method config classes; each raises ConfigError on a full key path."""

from __future__ import annotations

from hf_zero.config.errors import ConfigError


def check_ratio(value: float, path: str) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(path, f"dense_ratio is the fraction of weights kept and must be in (0, 1], got {value}")


def check_offset(start: int, path: str) -> None:
    """``schedule_offset``, which every method has: the step at which it starts."""
    if start < 0:
        raise ConfigError(f"{path}.schedule_offset", f"must be >= 0, got {start}")


def check_offsets(start: int, end: int | None, stride: int, path: str) -> None:
    check_offset(start, path)
    if end is not None and end < start:
        raise ConfigError(f"{path}.schedule_offset_end",
                          f"must be >= schedule_offset ({start}), got {end}")
    if stride < 1:
        raise ConfigError(f"{path}.schedule_offset_stride", f"must be >= 1, got {stride}")
