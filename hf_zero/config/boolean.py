"""What counts as a boolean in a config: DeepSpeed's config models (pydantic) take 0 / 1 and the usual words, so a
DeepSpeed config may say ``"enabled": 1`` or ``"overlap_comm": "yes"``. One reading for the parser and for the code
that looks at raw sections (``cfg.raw``, a config file) without parsing them."""

from __future__ import annotations

from typing import Any

__all__ = ["as_bool", "truthy"]

_TRUE_WORDS = frozenset({"true", "1", "yes", "on", "t", "y"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off", "f", "n"})


def as_bool(raw: Any) -> bool | None:
    """``raw`` as a boolean when it spells one (true/false, 0/1, the words above in any case); else None."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, (int, float)) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str):
        word = raw.lower()
        if word in _TRUE_WORDS or word in _FALSE_WORDS:
            return word in _TRUE_WORDS
    return None


def truthy(raw: Any) -> bool:
    """Whether a raw value switches something on (``"enabled": 1`` does; ``"auto"``, None and anything else do not)."""
    return as_bool(raw) is True
