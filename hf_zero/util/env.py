"""Reading hf_zero's on/off environment switches one way: the same spellings everywhere, and a value that is none
of them is an error naming the variable (a typo such as ``HF_ZERO_SHM_COMM=of`` must not leave the feature on)."""

from __future__ import annotations

import os

__all__ = ["env_flag", "TRUE_WORDS", "FALSE_WORDS"]

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """``os.environ[name]`` as a bool (1/true/yes/on, 0/false/no/off, any case); ``default`` when unset or empty.
    Anything else raises ValueError naming the variable and its value."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(TRUE_WORDS + FALSE_WORDS)}")
