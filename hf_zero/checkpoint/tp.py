"""Checkpoints of a tensor-parallel engine that reload at another TP size (and data-parallel size, ZeRO stage).

    <dir>/latest                       the tag
    <dir>/<tag>/manifest.json          size and sha256 of tp.json and of every TP rank's own manifest.json
    <dir>/<tag>/tp.json                the TP size at save time, each parameter's layout
    <dir>/<tag>/tp/rank00/state/...    TP rank 0's ordinary hf_zero checkpoint: the master weights and optimizer
    <dir>/<tag>/tp/rank01/state/...    states of its shards, cut over its data-parallel group; model.safetensors
                                       holds the whole gathered model (names and layout of the unsplit model).
                                       One directory per TP rank: each save cleans its own directory's leftovers

The tag is atomic as a whole (commit.py): built under ``<dir>/.tmp-<tag>/``, renamed into place once
every rank reported its part written, ``latest`` moved last; a failure on any TP rank raises on every rank.

Same TP size: each TP rank loads its own directory. Another TP size: each rank assembles a one-rank checkpoint
of exactly its current shards -- every parameter's full master / moments rebuilt from the saved TP ranks' pieces
(concatenated along the sharded dim, the fused q|k|v column order undone for the saved size and redone for the
current one: reshard.write_recut, the pipeline's re-stage's too) -- with its manifest, in a private temporary
directory, and loads it through the ordinary loader, which verifies it like any checkpoint and re-cuts it for the
current data-parallel group. Nothing is written into the checkpoint being read.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from hf_zero import comm
from hf_zero.checkpoint.commit import agree, agree_or_raise, check_tag, commit_tag
from hf_zero.checkpoint.disk_format import open_saved, read_latest_tag, read_model_file
from hf_zero.checkpoint.engine import load_checkpoint, save_checkpoint
from hf_zero.checkpoint.files import (MANIFEST, CheckpointError, check_client_state, file_entry, read_json,
                                      read_manifest, resolve_checkpoint, verify_files)
from hf_zero.checkpoint.placement import agree_on_tag
from hf_zero.checkpoint.reshard import TPCut, write_recut
from hf_zero.tensor_parallel import tp_info
from hf_zero.tensor_parallel.reshard import param_layout
from hf_zero.tensor_parallel.state import load_full_state_dict

__all__ = ["save_tp_checkpoint", "load_tp_checkpoint", "is_tp_checkpoint"]


logger = logging.getLogger("hf_zero")

_STATE = "state"
_INFO = "tp.json"


def _rank_root(root: Path, tp_rank: int) -> Path:
    return root / "tp" / f"rank{tp_rank:02d}"


def save_tp_checkpoint(engine, save_dir, *, tag=None, client_state=None, save_latest: bool = True,
                       exclude_frozen_parameters: bool = False) -> bool:
    """Collective over every rank: each TP rank's data-parallel group writes its own ordinary checkpoint into
    ``<dir>/.tmp-<tag>/``; the tag (tp.json, the manifest, every TP rank's part) is published whole once every rank
    reported its part written (commit.py), else every rank raises naming the rank that failed."""
    info = tp_info(engine.module)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    check_tag(tag)
    check_client_state(client_state or {})  # a TypeError on every rank before anything is written
    root = Path(save_dir)
    tp_rank, rank = info.mesh.get_local_rank(), dist.get_rank()
    # the gathered model, before any write can fail (a collective over the TP group, whose members are all their
    # data-parallel group's rank 0 -- the writer of model.safetensors -- or none of them; under ZeRO-3 a collective
    # over the data-parallel group as well, so every rank takes part and the writers keep it)
    module_state = None
    if engine.stage3 is not None:
        module_state = engine.module_state_dict(exclude_frozen_parameters)
        if engine.global_rank != 0:
            module_state = None
    elif engine.global_rank == 0:
        module_state = engine.module_state_dict(exclude_frozen_parameters)
    layouts = param_layout(engine.module)

    def write(tmp: Path) -> tuple[dict, None]:
        save_checkpoint(engine, _rank_root(tmp, tp_rank), tag=_STATE, client_state=client_state or {},
                        save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters,
                        module_state=module_state, recovery_script=False)
        name = f"{_rank_root(Path(), tp_rank).as_posix()}/{_STATE}/{MANIFEST}"
        # each part's writer: its manifest covers the part's files
        return ({name: file_entry(tmp / name)} if engine.global_rank == 0 else {}), None

    def finish(tmp: Path, _extras: list) -> dict:
        (tmp / _INFO).write_text(json.dumps({"tp_size": info.size, "params": layouts}))
        return {_INFO: file_entry(tmp / _INFO)}

    commit_tag(root, tag, is_writer=rank == 0, domain=list(range(dist.get_world_size())),
               me=f"rank {rank} (TP rank {tp_rank}, replica {engine.global_rank})", agree=agree,
               barrier=lambda w: comm.barrier(None, what=w), write=write, finish=finish, save_latest=save_latest,
               what=f"save_checkpoint({str(root)!r}, tag={tag!r})", label=f"save_tp_checkpoint(tag={tag!r})")
    return True


def is_tp_checkpoint(load_dir, tag=None) -> bool:
    tag = tag if tag is not None else read_latest_tag(Path(load_dir))
    if tag is None:
        return False
    try:
        return (resolve_checkpoint(Path(load_dir), str(tag)) / _INFO).is_file()
    except CheckpointError:
        return False  # the ordinary loader names the bad tag


def load_tp_checkpoint(engine, load_dir, *, tag=None, load_module_strict: bool = True,
                       load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True):
    """Collective over every rank. Also loads a TP checkpoint into an engine without tensor parallelism (TP 1).
    Everything it reads is verified against the manifests (tp.json, the parts' manifests, the gathered model, the
    shards of the part it loads or of every part it re-cuts) on every rank, and the ranks agree, before anything
    changes."""
    info = tp_info(engine.module)
    tag = agree_on_tag(dist.get_rank(), dist.get_world_size(), Path(load_dir), tag, read_latest_tag, agree)
    if tag is None:
        return None, None
    tp_size, tp_rank = (info.size, info.mesh.get_local_rank()) if info is not None else (1, 0)
    error, root, sd, where = None, None, None, None
    tmp = Path(tempfile.mkdtemp(prefix="hf_zero_tp_ckpt_"))
    try:
        try:
            root, saved, sd = _read_tag(Path(load_dir), str(tag))
            if saved["tp_size"] == tp_size:
                where = (_rank_root(root, tp_rank), _STATE)
                open_saved(where[0] / _STATE)  # its shards verified now, before the module below changes
            else:  # this rank's pieces, re-cut from every saved part (verified as they are opened)
                _recut(engine, root, saved, tp_size, tp_rank, tmp / "one")
                where = (tmp, "one")
        except Exception as exc:  # every rank must hear of it, or the others would wait for this one
            error = exc
        agree_or_raise(error, "load_checkpoint")
        # the module (frozen parameters and buffers included) from the gathered full weights
        load_full_state_dict(engine.module, sd, strict=load_module_strict)
        path, client_state = load_checkpoint(engine, where[0], tag=where[1], load_module_strict=load_module_strict,
                                             load_optimizer_states=load_optimizer_states,
                                             load_lr_scheduler_states=load_lr_scheduler_states,
                                             load_module_weights=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (path if where[0] != tmp else str(root)), client_state


def _read_tag(load_dir: Path, tag: str) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    """The tag's directory (its complete ``.old-`` copy after a crash between a same-tag save's renames), tp.json
    and the gathered model, verified against the manifests before they are parsed."""
    root = resolve_checkpoint(load_dir, tag)
    if not (root / _INFO).is_file():
        raise FileNotFoundError(f"hf_zero: {str(root)!r} is not a tensor-parallel checkpoint (no {_INFO}): it was "
                                "written without tensor_parallel.autotp_size; load it with the same setting")
    manifest = read_manifest(root)
    model = _rank_root(root, 0) / _STATE / "model.safetensors"
    if manifest is None:
        logger.warning("hf_zero: tensor-parallel checkpoint %r has no %s (saved before checksums); loading it "
                       "unverified", str(root), MANIFEST)
    else:
        verify_files(root, manifest, [_INFO] + sorted(n for n in manifest if n.startswith("tp/")))
        part = read_manifest(model.parent)
        if part is not None:
            verify_files(model.parent, part, [model.name])
    saved = read_json(root / _INFO)
    sd = read_model_file(model)
    return root, saved, sd


def _recut(engine, root: Path, saved: dict, tp: int, tp_rank: int, out: Path) -> None:
    """A one-rank checkpoint under ``out`` (with its manifest) holding this rank's current pieces of every group's
    state, re-cut from every saved TP rank's part (reshard.write_recut, the pipeline's re-stage's too)."""
    saved_tp = int(saved["tp_size"])
    info = tp_info(engine.module)
    cut = TPCut(saved_tp=saved_tp, tp=tp, tp_rank=tp_rank, saved_layouts=saved.get("params", {}),
                current_layouts=param_layout(engine.module) if info is not None else {},
                info_file=root / _INFO)
    write_recut(out, engine.groups, [[_rank_root(root, r) / _STATE for r in range(saved_tp)]], cut=cut,
                parts_root=root / "tp")
