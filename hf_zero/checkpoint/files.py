"""The file side of engine checkpoints: durable writes, checksums, safe tag resolution, errors that name the file.

* ``fsync`` every file and directory before a rename publishes it, so a power loss cannot publish a checkpoint
  whose bytes never reached the disk.
* ``manifest.json`` lists every file of a checkpoint with its size and sha256, computed at save; a load verifies
  every file it reads against it before it changes anything (a flipped bit, a truncated or missing file is an
  error naming the file).
* ``latest`` must name a plain directory inside the checkpoint directory; a crash between the two renames of a
  same-tag save leaves the complete previous copy under ``.old-<tag>``, which a load then uses.
* ``client_state`` must survive ``torch.load(weights_only=True)``: checked at save, with the key path and the type
  of what would not load.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "fsync_file", "fsync_dir", "sha256_file", "write_manifest", "read_manifest",
           "verify_files", "file_entry", "resolve_checkpoint", "clean_stale", "check_client_state", "read_json",
           "torch_load", "MANIFEST"]

MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored exactly; the message names the file and what is wrong with it."""


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A written file's manifest entry (size, sha256), after fsyncing it: what the manifest records is on disk."""
    fsync_file(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_manifest(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    path = directory / MANIFEST
    path.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    fsync_file(path)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} is unreadable or corrupt: {exc}") from exc


def read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The saved files and their checksums; None for a checkpoint written before manifests existed."""
    if not (directory / MANIFEST).is_file():
        return None
    files = read_json(directory / MANIFEST).get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"hf_zero: checkpoint file {str(directory / MANIFEST)!r} is corrupt (no 'files')")
    return files


def verify_files(directory: Path, manifest: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Every file in ``names`` is present, of the saved size and sha256 -- or a CheckpointError naming it."""
    for name in names:
        entry = manifest.get(name)
        path = directory / name
        if entry is None:
            raise CheckpointError(f"hf_zero: checkpoint {str(directory)!r}: {name!r} is not in its {MANIFEST}; the "
                                  f"checkpoint is incomplete or from another save")
        if not path.is_file():
            raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} is missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} has {size} bytes, {entry['bytes']} were "
                                  f"saved: it is truncated or was replaced")
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} is corrupt: its sha256 {digest[:16]}... "
                                  f"differs from the one recorded at save ({entry['sha256'][:16]}...)")


def _plain_name(tag: str) -> bool:
    return bool(tag) and "/" not in tag and "\\" not in tag and not tag.startswith(".") and tag not in ("..", ".")


def resolve_checkpoint(root: Path, tag: str) -> Path:
    """The directory of ``tag`` inside ``root``; after a crash between the renames of a same-tag save, the
    complete previous copy ``.old-<tag>``."""
    if not _plain_name(tag):
        raise CheckpointError(f"hf_zero: checkpoint tag {tag!r} (from {str(root / 'latest')!r} or the tag argument) "
                              f"must be a plain directory name inside {str(root)!r}")
    path = root / tag
    if path.resolve().parent != root.resolve():
        raise CheckpointError(f"hf_zero: checkpoint tag {tag!r} points outside {str(root)!r}")
    if not path.is_dir() and (root / f".old-{tag}" / MANIFEST).is_file():
        return root / f".old-{tag}"
    return path


def clean_stale(root: Path) -> None:
    """Remove what killed saves left: ``.tmp-*`` directories, and ``.old-<tag>`` where ``<tag>`` is complete."""
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(".tmp-"):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_dir() and p.name.startswith(".old-") and (root / p.name[len(".old-"):]).is_dir():
            shutil.rmtree(p, ignore_errors=True)


def torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` (no pickled code runs), errors naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} is missing") from None
    except Exception as exc:
        raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} cannot be loaded: "
                              f"{type(exc).__name__}: {exc}") from exc


def check_client_state(state: Any) -> None:
    """Refuse, at save, a ``client_state`` that ``load_checkpoint`` could not read back (it loads with
    ``weights_only=True``): the error gives the key path and the type."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
        return
    except Exception:
        pass
    path, value = _first_unloadable(state, "client_state")
    raise TypeError(
        f"hf_zero: save_checkpoint: {path} is a {type(value).__module__}.{type(value).__qualname__}, which "
        f"load_checkpoint cannot read back (checkpoints load with torch.load(weights_only=True), which runs no "
        f"pickled code). Store tensors, numbers, strings, bools, None and lists/tuples/dicts of them: e.g. "
        f"torch.from_numpy(array) or array.tolist(), float(numpy_scalar), str(path), dataclasses.asdict(obj), "
        f"torch.get_rng_state() instead of numpy's RNG state tuple.")


def _first_unloadable(value: Any, path: str) -> tuple[str, Any]:
    if isinstance(value, dict):
        for k, v in value.items():
            found = _first_unloadable(v, f"{path}[{k!r}]")
            if found[1] is not None:
                return found
    elif isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        for i, v in enumerate(value):
            found = _first_unloadable(v, f"{path}[{i}]")
            if found[1] is not None:
                return found
    else:
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        try:
            torch.load(buf, weights_only=True)
        except Exception:
            return path, value
        return path, None
    if type(value) not in (dict, list, tuple):
        return path, value  # a dict/list subclass (OrderedDict loads; others do not)
    return path, None
