"""Process-wide settings of hf_zero's collectives: the bound on every wait and the divergence check.

Its own module so that every other comm module can read them without importing the machinery that uses them
(process_group needs the default timeout when it creates the group; faults.py applies both). Imports no sibling.
"""

from __future__ import annotations

import os

__all__ = ["DEFAULT_TIMEOUT_S", "default_timeout_s", "configure", "timeout_s", "checks_enabled",
           "created_by_hf_zero", "mark_created_by_hf_zero"]

DEFAULT_TIMEOUT_S = 300.0  # well under torch's 30-minute default; raised by comms_timeout_s for slow jobs

_settings = {"timeout_s": None, "check": True, "created_here": False}


def default_timeout_s() -> float:
    """``DEEPSPEED_TIMEOUT`` (minutes, DeepSpeed's variable) when set, else :data:`DEFAULT_TIMEOUT_S`."""
    minutes = os.environ.get("DEEPSPEED_TIMEOUT")
    return float(minutes) * 60.0 if minutes else DEFAULT_TIMEOUT_S


def configure(*, timeout_s: float | None = None, divergence_check: bool | None = None) -> None:
    """Set the bound on every hf_zero collective and the per-collective check (process-wide; live channels follow)."""
    if timeout_s is not None:
        if not timeout_s > 0:
            raise ValueError(f"hf_zero: comms_timeout_s must be > 0, got {timeout_s!r}")
        _settings["timeout_s"] = float(timeout_s)
    if divergence_check is not None:
        _settings["check"] = bool(divergence_check)


def timeout_s() -> float:
    return _settings["timeout_s"] if _settings["timeout_s"] is not None else default_timeout_s()


def checks_enabled() -> bool:
    return bool(_settings["check"])


def created_by_hf_zero() -> bool:
    """Whether hf_zero created the default process group (then it owns its timeout)."""
    return bool(_settings["created_here"])


def mark_created_by_hf_zero() -> None:
    _settings["created_here"] = True
