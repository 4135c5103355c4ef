"""The engine's refusals of a call where DeepSpeed asserts.

DeepSpeed guards its engine API with ``assert``: a non-scalar loss, ``step()`` inside ``no_sync()``, a nested block.
Scripts (and DeepSpeed's own tests) catch ``AssertionError`` there, while hf_zero's callers catch ``RuntimeError``;
:class:`UsageError` is both, so a DeepSpeed script's handler and hf_zero's see the same refusal.
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(RuntimeError, AssertionError):
    """A call the engine refuses in its current state (the message names the call and what to do instead)."""
