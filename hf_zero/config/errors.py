"""The one error type for bad configuration, and the typo suggestion that goes with it."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

__all__ = ["ConfigAssertionError", "ConfigError", "check_keys", "closest", "unknown_key"]


class ConfigError(ValueError):
    """Anything wrong in a config: an unknown key, a wrong type or value, a contradiction.

    The message always starts with the full dotted key path the user wrote (``zero_optimization.stage``),
    so the user can find it in their JSON file, and says what would be accepted.
    """

    def __init__(self, key_path: str, message: str):
        self.key_path = key_path
        self.detail = message  # the message without the key path, for re-raising under a longer path
        super().__init__(f"{key_path}: {message}" if key_path else message)

    def __reduce__(self):
        # rebuilt from both arguments: an exception pickles as cls(*args), and args holds only the joined message
        # -- a worker pool handing this error back to its parent (multiprocessing) would otherwise hang there
        return (type(self), (self.key_path, self.detail), self.__dict__)


class ConfigAssertionError(ConfigError, AssertionError):
    """A ConfigError where DeepSpeed asserts (a setting that forbids a call or a combination): scripts written for
    DeepSpeed catch AssertionError there."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate a typo most likely meant, or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key(key: Any, accepted: Iterable[str], path: str, what: str = "unknown key",
                error: type[ConfigError] = ConfigError) -> ConfigError:
    """The error for ``key`` (at ``path``, the full dotted path) not being one of ``accepted``: the likely typo,
    else every accepted key in the order given. ``error``: a ConfigError subclass a section raises instead."""
    accepted = list(accepted)
    guess = closest(str(key), accepted)
    return error(path, f"{what}; " + (f"did you mean {guess!r}?" if guess else
                                      f"accepted keys: {', '.join(map(str, accepted))}"))


def check_keys(section: Any, accepted: Iterable[str], path: str, what: str = "unknown key",
               error: type[ConfigError] = ConfigError) -> None:
    """Refuse the first key of the mapping ``section`` (found at ``path``) that is not in ``accepted``."""
    accepted = list(accepted)
    for key in section:
        if key not in accepted:
            raise unknown_key(key, accepted, f"{path}.{key}" if path else str(key), what, error)
