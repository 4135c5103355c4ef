"""Pipeline checkpoints that reload on another number of stages (and data-parallel replicas, ZeRO stage, and with
tensor parallelism inside the stages -- 3D -- another TP size).

    <dir>/latest                                  the tag
    <dir>/<tag>/manifest.json                     size and sha256 of pipeline.json, every layer file and every
                                                  stage checkpoint's own manifest.json (which covers its files)
    <dir>/<tag>/pipeline.json                     stages, data-parallel size, layer boundaries, TP size at save time;
                                                  with TP, how each parameter was split (full shape, dim, fused)
    <dir>/<tag>/layer_05-model_states.pt          DeepSpeed's per-layer module files (the weights of layer 5; full
                                                  tensors: a TP stage's shards are gathered, and one rank writes)
    <dir>/<tag>/pipe/stage01/zero/...             stage 1's ordinary hf_zero checkpoint (masters, optimizer state
                                                  shards, counters, scheduler), written by its replicas (each stage
                                                  under its own root: the saver cleans stale files in its root)
    <dir>/<tag>/pipe/stage01-tp00/zero/...        with TP, one per (stage, TP rank): the masters and optimizer
                                                  states of that rank's shards, cut over its replicas

The tag is atomic as a whole (hf_zero/checkpoint/commit.py, as the ordinary checkpoint): built under
``<dir>/.tmp-<tag>/``, published by one rename once every rank reported its parts written, ``latest`` moved last;
a failure on any rank raises on every rank, naming it, and leaves the previous tag (same name included) as it was.
A load verifies pipeline.json, the stage manifests and the layer files it uses against the manifest before it
changes anything.

Parameters are named by the model, not by the stage (``3.weight``: layer 3 wherever it runs; HF names for a
wrapped HF model), so a stage of a different cut finds each of its parameters in whichever saved stage held it.
Loading with the same stages (and TP size) reads the stage's own checkpoint; otherwise every rank assembles a
one-rank checkpoint of exactly its stage's parameters (full masters and optimizer states, from the saved shards:
pipeline_cut.restage, reshard.write_recut) in a private temporary directory -- nothing is written into the
checkpoint being read, which may be read-only -- and loads that through the ordinary loader, which verifies it
against its manifest like any checkpoint and re-cuts it for the current replicas and ZeRO stage.

Tensor parallelism (hf_zero/checkpoint/pipeline_tp.py): the optimizer state stays in per-TP-rank shards plus
the layout in pipeline.json -- the format of a TP engine's checkpoint (tp.py) and of the stages' own:
a save is the ordinary per-rank write of each (stage, TP rank) with no gather of the optimizer state, and a
reload re-cuts per parameter (saved TP pieces -> the full tensor -> this rank's piece) inside the same assembly
that re-stages. The module (frozen parameters and buffers included) is loaded from the per-layer files, whose
full tensors any cut and TP size can slice.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from hf_zero import comm
from hf_zero.checkpoint.commit import agree, agree_or_raise, check_tag, commit_tag
from hf_zero.checkpoint.disk_format import read_latest_tag
from hf_zero.checkpoint.engine import load_checkpoint, save_checkpoint
from hf_zero.checkpoint.files import (MANIFEST, check_client_state, file_entry, read_json, read_manifest,
                                      resolve_checkpoint, verify_files)
from hf_zero.checkpoint.pipeline_cut import (INFO, RESTAGED, ZERO_TAG, layer_file, restage, same_cut, stage_tag,
                                            tp_coords)
from hf_zero.checkpoint.pipeline_tp import load_tp_pipeline_checkpoint
from hf_zero.checkpoint.placement import agree_on_tag
from hf_zero.tensor_parallel.reshard import param_layout

__all__ = ["save_pipeline_checkpoint", "load_pipeline_checkpoint"]

logger = logging.getLogger("hf_zero")

def save_pipeline_checkpoint(engine, save_dir, *, tag=None, client_state=None, save_latest: bool = True) -> bool:
    """Collective over every rank; the tag is published whole or not at all (commit.py): everything is
    written under ``<dir>/.tmp-<tag>/``, the ranks agree that every part was written, rank 0 adds pipeline.json and
    the manifest (every layer file, pipeline.json and each stage checkpoint's own manifest, with their sha256),
    renames the tag into place, and only then moves ``latest``. A failure on any rank raises
    :class:`~hf_zero.checkpoint.commit.SaveError` on every rank, naming it; the previous tag is untouched."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    check_tag(tag)
    check_client_state(client_state or {})  # a TypeError on every rank before anything is written
    root = Path(save_dir)
    grid = engine.grid
    tp, tp_rank = tp_coords(engine)
    rank = dist.get_rank()
    # the collectives of the module's gathers first, on every rank (over the TP group / the replicas): a part that
    # fails below must not leave its peers waiting inside one of them
    layers: dict[int, dict[str, torch.Tensor]] = {}
    if engine.stage3 is not None:
        from hf_zero.zero.gathered import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):  # collective over the replicas
            if grid.data_parallel_id == 0:
                layers = {i: {k: v.detach().clone() for k, v in sd.items()} for i, sd in
                          engine.module.layer_state_dicts().items()}
    elif grid.data_parallel_id == 0:
        layers = engine.module.layer_state_dicts()  # with TP: gathers the shards (collective over the TP group)
    writes_layers = grid.data_parallel_id == 0 and tp_rank == 0  # TP peers hold the same full tensors
    # how each stage's parameters are split: one stage's TP rank 0 of the first replica answers
    layouts = param_layout(engine.module) if tp > 1 and writes_layers else {}
    stage = stage_tag(engine.stage_id, tp_rank, tp)

    def write(tmp: Path) -> tuple[dict, dict]:
        # every (stage, TP rank)'s replicas write their own ordinary checkpoint, side by side; with TP the module
        # is in the per-layer files only (a gathered copy per TP rank would be the same bytes TP times)
        save_checkpoint(engine, tmp / "pipe" / stage, tag=ZERO_TAG, client_state=client_state or {},
                        save_latest=False, exclude_frozen_parameters=False, write_model=tp == 1,
                        recovery_script=False)
        entries = {}
        if engine.global_rank == 0:  # the stage checkpoint's writer: its manifest covers its files
            name = f"pipe/{stage}/{ZERO_TAG}/{MANIFEST}"
            entries[name] = file_entry(tmp / name)
        if writes_layers:
            for idx, sd in layers.items():
                name = layer_file(idx)
                torch.save({k: v.detach().cpu() for k, v in sd.items()}, tmp / name)
                entries[name] = file_entry(tmp / name)
        return entries, layouts

    def finish(tmp: Path, extras: list[dict]) -> dict:
        info = {"num_stages": engine.num_stages, "data_parallel_size": grid.data_parallel_size,
                "parts": list(getattr(engine.module, "parts", [])), "virtual_stages": engine.module.virtual_stages,
                "tp_size": tp}
        if tp > 1:
            info["params"] = {k: v for d in extras for k, v in d.items()}
        (tmp / INFO).write_text(json.dumps(info))
        return {INFO: file_entry(tmp / INFO)}

    where = f"stage {engine.stage_id}" + (f", TP rank {tp_rank}" if tp > 1 else "") + \
        f", replica {grid.data_parallel_id}"
    commit_tag(root, tag, is_writer=rank == 0, domain=list(range(dist.get_world_size())),
               me=f"rank {rank} ({where})", agree=agree, barrier=lambda w: comm.barrier(None, what=w), write=write,
               finish=finish, save_latest=save_latest, what=f"save_checkpoint({str(root)!r}, tag={tag!r})",
               label=f"save_pipeline_checkpoint(tag={tag!r})")
    return True


def load_pipeline_checkpoint(engine, load_dir, *, tag=None, load_optimizer_states: bool = True,
                             load_lr_scheduler_states: bool = True, load_module_strict: bool = True):
    # every rank loads the same tag, or none does
    tag = agree_on_tag(dist.get_rank(), dist.get_world_size(), Path(load_dir), tag, read_latest_tag, agree)
    if tag is None:
        return None, None
    error, root, info, manifest = None, None, None, None
    try:
        root, info, manifest = _read_info(engine, Path(load_dir), str(tag))
    except Exception as exc:  # every rank must hear of it, or the others would wait for this one
        error = exc
    agree_or_raise(error, "load_checkpoint")
    saved_tp = int(info.get("tp_size", 1))
    tp, _ = tp_coords(engine)
    if tp > 1 or saved_tp > 1:
        return load_tp_pipeline_checkpoint(engine, root, info, manifest, load_optimizer_states=load_optimizer_states,
                                           load_lr_scheduler_states=load_lr_scheduler_states,
                                           load_module_strict=load_module_strict)
    if same_cut(engine, info):
        return load_checkpoint(engine, root / "pipe" / stage_tag(engine.stage_id), tag=ZERO_TAG,
                               load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states)
    # another cut: every rank re-cuts its own parameters from the saved stages into a private temporary directory
    # (nothing is written into the checkpoint being read) and loads that through the ordinary, verifying loader
    with tempfile.TemporaryDirectory(prefix="hf_zero_restage_") as tmp:
        out = Path(tmp) / RESTAGED
        error = None
        try:
            restage(engine, root, info, out)
        except Exception as exc:  # every rank must hear of it, or the others would wait for this one
            error = exc
        agree_or_raise(error, "load_checkpoint (re-cutting the saved stages)")
        _, client_state = load_checkpoint(engine, out.parent, tag=out.name, load_module_strict=load_module_strict,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states)
    return str(root), client_state


def _read_info(engine, load_dir: Path, tag: str) -> tuple[Path, dict, dict | None]:
    """The tag's directory (its complete ``.old-`` copy after a crash between a same-tag save's renames), its
    pipeline.json and manifest -- verified before they are parsed: pipeline.json, every stage checkpoint's manifest
    and (without TP: TP loads read and verify theirs in read_layer_files) the layer files of this stage's layers.
    A checkpoint saved before pipeline manifests existed loads unverified, with a warning."""
    root = resolve_checkpoint(load_dir, tag)
    info_path = root / INFO
    if not info_path.is_file():
        raise FileNotFoundError(f"hf_zero: {str(root)!r} is not a pipeline checkpoint (no {INFO})")
    manifest = read_manifest(root)
    if manifest is None:
        logger.warning("hf_zero: pipeline checkpoint %r has no %s (saved before checksums); loading it unverified",
                       str(root), MANIFEST)
        return root, read_json(info_path), None
    verify_files(root, manifest, [INFO] + sorted(n for n in manifest if n.startswith("pipe/")))
    info = read_json(info_path)
    if int(info.get("tp_size", 1)) == 1 and tp_coords(engine)[0] == 1:
        units = engine.module.layer_state_dicts()  # no collective without TP: the keys are this stage's layers
        verify_files(root, manifest, [layer_file(u) for u in sorted(units) if layer_file(u) in manifest])
    return root, info, manifest
