"""How a checkpoint tag becomes visible: all of it, or none of it. Shared by the ordinary engine checkpoint
(engine.py) and the composites built of ordinary ones -- a pipeline's per-layer files, pipeline.json and one
checkpoint per stage (pipeline.py); a TP engine's tp.json and one checkpoint per TP rank (tp.py)
-- so that a composite is atomic as a whole, not part by part.

:func:`commit_tag`, collective over the ranks that ``agree`` spans:

1. the writer removes what killed saves left (``clean_stale``) and creates ``<root>/.tmp-<tag>``; the ranks agree
   that it exists (a rank that cannot create it would otherwise leave the others waiting);
2. every rank writes its parts into it (``write``; a part may itself be an ordinary checkpoint committed inside
   the temporary directory) and reports its files' sizes and sha256; the ranks agree -- one all-gather, bounded
   by comms_timeout_s -- that every rank wrote. Else every rank raises :class:`SaveError` naming the rank that
   failed and its error, and the writer removes the temporary directory: the previous tag and ``latest`` are
   untouched;
3. the writer adds what needs every rank's report (``finish``: pipeline.json), writes ``manifest.json`` (every
   file with its size and sha256: a load verifies what it reads before it changes anything), fsyncs every
   directory, and renames the tag into place; a same-tag save keeps the previous copy as ``.old-<tag>`` until the
   new one is in place (resolve_checkpoint falls back to it after a crash between the two renames);
4. the ranks agree that every writer's rename succeeded; only then ``latest`` moves (atomically: written aside,
   fsynced, renamed).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from hf_zero import comm
from hf_zero.comm import faults
from hf_zero.checkpoint.files import CheckpointError, clean_stale, fsync_dir, fsync_file, write_manifest

__all__ = ["SaveError", "agree", "agree_or_raise", "check_tag", "commit_tag", "error_report", "rename_into_place",
           "write_latest"]

Agree = Callable[[Any, str], list]


class SaveError(RuntimeError):
    """A collective save failed on some rank and nothing was published. ``own``: the failure was this rank's (the
    others only heard of it); ``__cause__`` is then the rank's own error."""

    def __init__(self, message: str, own: bool):
        super().__init__(message)
        self.own = own


def check_tag(tag: str) -> None:
    """A save's tag is a plain directory name (it becomes ``<root>/<tag>``, ``.tmp-<tag>`` and ``latest``)."""
    if "/" in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain directory name")


def agree(mine: Any, what: str, group=None) -> list[Any]:
    """Every rank's ``mine`` (a small picklable value) on every rank of ``group`` (None: the world), within
    comms_timeout_s."""
    if not comm.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return [mine]
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    with faults.bounded(what, group):
        torch.distributed.all_gather_object(out, mine, group=group)
    return out


def error_report(exc: BaseException | None) -> tuple[str, bool] | None:
    """``(message, own)`` for a peer to print: a nested save's SaveError is reported by its cause (the rank that
    failed there says what failed, not that a save failed); ``own`` is False where the rank only heard of it."""
    if exc is None:
        return None
    if isinstance(exc, SaveError):
        cause = exc.__cause__ if exc.own and exc.__cause__ is not None else exc
        return f"{type(cause).__name__}: {cause}", exc.own
    return f"{type(exc).__name__}: {exc}", True


def agree_or_raise(error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed ``what`` (one all-gather over the world, bounded by
    comms_timeout_s), and all raise -- the failing rank its own error, the others a CheckpointError naming it --
    before anything was changed."""
    reports = agree(None if error is None else f"{type(error).__name__}: {error}", f"the agreement of {what}")
    if error is not None:
        raise error
    failed = [r for r, msg in enumerate(reports) if msg is not None]
    if failed:
        raise CheckpointError(f"hf_zero: {what} failed on rank {failed[0]} (nothing was loaded): {reports[failed[0]]}")


def _first_failure(reports: list) -> int | None:
    """The rank to name: the first whose failure was its own, else the first that failed."""
    failed = [r for r, rep in enumerate(reports) if rep is not None]
    own = [r for r in failed if reports[r][1]]
    return (own or failed or [None])[0]


def commit_tag(root: Path, tag: str, *, is_writer: bool, domain: list[int], me: str, agree: Agree,
               barrier: Callable[[str], None], write: Callable[[Path], tuple[dict, Any]], save_latest: bool,
               what: str, label: str, finish: Callable[[Path, list], dict] | None = None) -> None:
    """Publish ``<root>/<tag>`` atomically (see the module docstring); collective over ``agree``'s ranks.

    ``write(tmp)`` writes this rank's parts into the temporary directory and returns ``(manifest entries (path
    relative to it -> size and sha256), extra)``; every rank's ``extra`` goes to the writer's ``finish(tmp,
    extras)``, which writes the writer's own files and returns their entries. ``domain``: the ranks whose files
    are in this writer's directory (with node-local storage, one directory per node). ``me`` names this rank in
    the errors every rank raises; ``what`` names the save (with its path), ``label`` the collectives (no path:
    the same on every rank). Raises :class:`SaveError` on every rank when any rank failed."""
    tmp, final = root / f".tmp-{tag}", root / tag
    error: BaseException | None = None
    if is_writer:
        try:
            root.mkdir(parents=True, exist_ok=True)
            clean_stale(root)
            tmp.mkdir()
        except OSError as exc:  # reported to every rank below, which would otherwise wait for this one
            error = exc
    started = agree((me, error_report(error)), f"the start of {label}")
    who = [w for w, _ in started]
    r = _first_failure([rep for _, rep in started])
    if r is not None:
        raise SaveError(f"hf_zero: {what}: cannot create its directory on {who[r]} ({started[r][1][0]}); the "
                        f"previous checkpoint is untouched", own=error is not None) from error
    entries: dict[str, dict[str, Any]] = {}
    extra = None
    try:
        entries, extra = write(tmp)
    except Exception as exc:  # every rank must reach the agreement below, or the others would hang
        error = exc
    reports = agree((error_report(error), entries, extra), f"the agreement of {label}")
    r = _first_failure([rep for rep, _, _ in reports])
    if r is not None:
        if is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier(f"the clean-up of a failed {label}")  # no rank starts another save into a directory being removed
        raise SaveError(f"hf_zero: {what} failed on {who[r]} ({reports[r][0][0]}); the previous checkpoint is "
                        f"untouched", own=error is not None) from error
    if is_writer:
        try:
            manifest = {name: e for i in domain for name, e in reports[i][1].items()}
            if finish is not None:
                manifest.update(finish(tmp, [x for _, _, x in reports]))
            write_manifest(tmp, manifest)
            for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
                fsync_dir(d)  # the directory entries of nested parts, deepest first
            fsync_dir(tmp)
            rename_into_place(root, tmp, final, tag)
        except Exception as exc:
            error = exc
    # every directory's tag is in place before any 'latest' moves (with one directory per node, a node whose
    # rename failed would otherwise be left behind the others)
    renamed = agree(error_report(error), f"the rename agreement of {label}")
    if error is not None:
        raise error
    r = _first_failure(renamed)
    if r is not None:
        raise SaveError(f"hf_zero: {what} failed to finalize on {who[r]} ({renamed[r][0]}); 'latest' still names "
                        f"the previous checkpoint", own=False)
    if is_writer and save_latest:
        write_latest(root, tag)
    barrier(f"the end of {label}")


def rename_into_place(root: Path, tmp: Path, final: Path, tag: str) -> None:
    """The writer: rename the complete, fsynced ``tmp`` into place. A same-tag save keeps the previous copy as
    ``.old-<tag>`` until the new one is in place (a load falls back to it after a crash)."""
    old = root / f".old-{tag}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        _rename(final, old)
    _rename(tmp, final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def write_latest(root: Path, tag: str) -> None:
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(tag)
    fsync_file(latest_tmp)
    os.replace(latest_tmp, root / "latest")
    fsync_dir(root)


def _rename(src: Path, dst: Path) -> None:
    src.rename(dst)  # a module-level function: tests replace it to simulate a crash between the renames
