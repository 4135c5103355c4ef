"""``checkpoint.tag_validation``: every rank saves under the same tag.

DeepSpeed hashes the tag and compares it across ranks at every ``save_checkpoint``; with "Warn" (its default) it logs
and lets each rank write under its own tag, which leaves a checkpoint no world size can load (each tag directory
holds a fraction of the shards). hf_zero finalizes one tag directory atomically, so it cannot do that: the ranks'
tags are gathered (one small all-gather over every rank, bounded by comms_timeout_s) and

* ``fail``: every rank raises before anything is written, naming the ranks and their tags;
* ``warn`` (default): a warning names them, and every rank saves under rank 0's tag;
* ``ignore``: every rank saves under rank 0's tag, without a message.

The tags are compared over the whole world, not the engine's data-parallel group: under pipeline or tensor
parallelism every rank writes part of the same checkpoint.
"""

from __future__ import annotations

import logging

from hf_zero.checkpoint.commit import agree

__all__ = ["resolve_save_tag", "TagMismatchError"]

log = logging.getLogger("hf_zero")
KEY = "checkpoint.tag_validation"


class TagMismatchError(ValueError, AssertionError):
    """``tag_validation: fail`` and the ranks' tags differ. Also an AssertionError: DeepSpeed asserts there."""


def resolve_save_tag(tag, default: str, policy: str) -> str:
    """The tag this rank saves under: ``tag`` (or ``default``) when every rank agrees, else per ``policy``."""
    mine = str(tag) if tag is not None else default
    tags = agree(mine, "the tag check of save_checkpoint")
    if len(set(tags)) == 1:
        return mine
    groups: dict[str, list[int]] = {}
    for r, t in enumerate(tags):
        groups.setdefault(t, []).append(r)
    seen = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {t!r}" for t, rs in groups.items())
    if policy == "fail":
        raise TagMismatchError(f"hf_zero: save_checkpoint: the ranks passed different tags ({seen}); nothing was written. "
                         f"Pass the same tag on every rank (or set {KEY} to 'warn' to save under rank 0's tag)")
    if policy == "warn":
        log.warning("hf_zero: save_checkpoint: the ranks passed different tags (%s); saving under rank 0's tag %r "
                    "on every rank (%s: 'fail' refuses instead, 'ignore' silences this)", seen, tags[0], KEY)
    return tags[0]
