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

The tag is atomic as a whole (hf_zero/runtime/checkpoint_commit.py, as the ordinary checkpoint): built under
``<dir>/.tmp-<tag>/``, published by one rename once every rank reported its parts written, ``latest`` moved last;
a failure on any rank raises on every rank, naming it, and leaves the previous tag (same name included) as it was.
A load verifies pipeline.json, the stage manifests and the layer files it uses against the manifest before it
changes anything.

Parameters are named by the model, not by the stage (``3.weight``: layer 3 wherever it runs; HF names for a
wrapped HF model), so a stage of a different cut finds each of its parameters in whichever saved stage held it.
Loading with the same stages (and TP size) reads the stage's own checkpoint; otherwise the stage's replicas
assemble a one-rank checkpoint of exactly their parameters (full masters and optimizer states, from the saved
shards) and load that through the ordinary loader, which re-cuts it for the current replicas and ZeRO stage.

Tensor parallelism (hf_zero/runtime/pipe_tp_checkpoint.py): the optimizer state stays in per-TP-rank shards plus
the layout in pipeline.json -- the format of a TP engine's checkpoint (tp_checkpoint.py) and of the stages' own:
a save is the ordinary per-rank write of each (stage, TP rank) with no gather of the optimizer state, and a
reload re-cuts per parameter (saved TP pieces -> the full tensor -> this rank's piece) inside the same assembly
that re-stages. The module (frozen parameters and buffers included) is loaded from the per-layer files, whose
full tensors any cut and TP size can slice.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from hf_zero import comm
from hf_zero.runtime.checkpoint import (_full_param_from_shards, _rank_file, load_checkpoint, open_saved,
                                        read_latest_tag, save_checkpoint)
from hf_zero.runtime.checkpoint_commit import agree, agree_or_raise, check_tag, commit_tag
from hf_zero.runtime.checkpoint_files import (MANIFEST, CheckpointError, check_client_state, file_entry, read_json,
                                              read_manifest, resolve_checkpoint, sha256_file, verify_files,
                                              write_manifest)
from hf_zero.runtime.checkpoint_nodes import agree_on_tag
from hf_zero.tensor_parallel import tp_info
from hf_zero.tensor_parallel.reshard import full_from_pieces, param_layout, piece_for, replicated_layout
from hf_zero.zero.layout import ShardLayout

__all__ = ["save_pipeline_checkpoint", "load_pipeline_checkpoint"]

logger = logging.getLogger("hf_zero")

_ZERO_TAG = "zero"
_INFO = "pipeline.json"


def _stage_tag(stage: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    return f"stage{stage:02d}" if tp_size == 1 else f"stage{stage:02d}-tp{tp_rank:02d}"


def _tp_coords(engine) -> tuple[int, int]:
    """(TP size, this rank's TP rank); (1, 0) without tensor parallelism."""
    info = tp_info(engine.module)
    return (info.size, info.mesh.get_local_rank()) if info is not None else (1, 0)


def save_pipeline_checkpoint(engine, save_dir, *, tag=None, client_state=None, save_latest: bool = True) -> bool:
    """Collective over every rank; the tag is published whole or not at all (checkpoint_commit.py): everything is
    written under ``<dir>/.tmp-<tag>/``, the ranks agree that every part was written, rank 0 adds pipeline.json and
    the manifest (every layer file, pipeline.json and each stage checkpoint's own manifest, with their sha256),
    renames the tag into place, and only then moves ``latest``. A failure on any rank raises
    :class:`~hf_zero.runtime.checkpoint_commit.SaveError` on every rank, naming it; the previous tag is untouched."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    check_tag(tag)
    check_client_state(client_state or {})  # a TypeError on every rank before anything is written
    root = Path(save_dir)
    grid = engine.grid
    tp, tp_rank = _tp_coords(engine)
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
    stage = _stage_tag(engine.stage_id, tp_rank, tp)

    def write(tmp: Path) -> tuple[dict, dict]:
        # every (stage, TP rank)'s replicas write their own ordinary checkpoint, side by side; with TP the module
        # is in the per-layer files only (a gathered copy per TP rank would be the same bytes TP times)
        save_checkpoint(engine, tmp / "pipe" / stage, tag=_ZERO_TAG, client_state=client_state or {},
                        save_latest=False, exclude_frozen_parameters=False, write_model=tp == 1,
                        recovery_script=False)
        entries = {}
        if engine.global_rank == 0:  # the stage checkpoint's writer: its manifest covers its files
            name = f"pipe/{stage}/{_ZERO_TAG}/{MANIFEST}"
            entries[name] = file_entry(tmp / name)
        if writes_layers:
            for idx, sd in layers.items():
                name = _layer_file(idx)
                torch.save({k: v.detach().cpu() for k, v in sd.items()}, tmp / name)
                entries[name] = file_entry(tmp / name)
        return entries, layouts

    def finish(tmp: Path, extras: list[dict]) -> dict:
        info = {"num_stages": engine.num_stages, "data_parallel_size": grid.data_parallel_size,
                "parts": list(getattr(engine.module, "parts", [])), "virtual_stages": engine.module.virtual_stages,
                "tp_size": tp}
        if tp > 1:
            info["params"] = {k: v for d in extras for k, v in d.items()}
        (tmp / _INFO).write_text(json.dumps(info))
        return {_INFO: file_entry(tmp / _INFO)}

    where = f"stage {engine.stage_id}" + (f", TP rank {tp_rank}" if tp > 1 else "") + \
        f", replica {grid.data_parallel_id}"
    commit_tag(root, tag, is_writer=rank == 0, domain=list(range(dist.get_world_size())),
               me=f"rank {rank} ({where})", agree=agree, barrier=lambda w: comm.barrier(None, what=w), write=write,
               finish=finish, save_latest=save_latest, what=f"save_checkpoint({str(root)!r}, tag={tag!r})",
               label=f"save_pipeline_checkpoint(tag={tag!r})")
    return True


def _layer_file(unit: int) -> str:
    return f"layer_{unit:02d}-model_states.pt"


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
    tp, _ = _tp_coords(engine)
    if tp > 1 or saved_tp > 1:
        from hf_zero.runtime.pipe_tp_checkpoint import load_tp_pipeline_checkpoint

        return load_tp_pipeline_checkpoint(engine, root, info, manifest, load_optimizer_states=load_optimizer_states,
                                           load_lr_scheduler_states=load_lr_scheduler_states,
                                           load_module_strict=load_module_strict)
    if _same_cut(engine, info):
        return load_checkpoint(engine, root / "pipe" / _stage_tag(engine.stage_id), tag=_ZERO_TAG,
                               load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states)
    grid = engine.grid
    merged = _restage_dir(engine, root)
    error = None
    if grid.data_parallel_id == 0:
        try:
            _assemble(engine, root, info, merged)
        except Exception as exc:  # every rank must hear of it, or the others would wait for this one
            error = exc
    agree_or_raise(error, "load_checkpoint (re-cutting the saved stages)")
    try:
        return load_checkpoint(engine, merged.parent, tag=merged.name, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states)
    finally:
        comm.barrier(None, what="the end of load_pipeline_checkpoint")
        if grid.data_parallel_id == 0:
            shutil.rmtree(merged.parent, ignore_errors=True)


def _read_info(engine, load_dir: Path, tag: str) -> tuple[Path, dict, dict | None]:
    """The tag's directory (its complete ``.old-`` copy after a crash between a same-tag save's renames), its
    pipeline.json and manifest -- verified before they are parsed: pipeline.json, every stage checkpoint's manifest
    and (without TP: TP loads read and verify theirs in read_layer_files) the layer files of this stage's layers.
    A checkpoint saved before pipeline manifests existed loads unverified, with a warning."""
    root = resolve_checkpoint(load_dir, tag)
    info_path = root / _INFO
    if not info_path.is_file():
        raise FileNotFoundError(f"hf_zero: {str(root)!r} is not a pipeline checkpoint (no {_INFO})")
    manifest = read_manifest(root)
    if manifest is None:
        logger.warning("hf_zero: pipeline checkpoint %r has no %s (saved before checksums); loading it unverified",
                       str(root), MANIFEST)
        return root, read_json(info_path), None
    verify_files(root, manifest, [_INFO] + sorted(n for n in manifest if n.startswith("pipe/")))
    info = read_json(info_path)
    if int(info.get("tp_size", 1)) == 1 and _tp_coords(engine)[0] == 1:
        units = engine.module.layer_state_dicts()  # no collective without TP: the keys are this stage's layers
        verify_files(root, manifest, [_layer_file(u) for u in sorted(units) if _layer_file(u) in manifest])
    return root, info, manifest


def _same_cut(engine, info: dict) -> bool:
    """Whether this engine's stages hold exactly the saved stages' parameters, split the same way."""
    parts = list(getattr(engine.module, "parts", []))
    return (info["num_stages"] == engine.num_stages and (not info.get("parts") or info["parts"] == parts)
            and int(info.get("tp_size", 1)) == _tp_coords(engine)[0])


def _restage_dir(engine, root: Path) -> Path:
    """Where this (stage, TP rank)'s replicas assemble their one-rank checkpoint (removed after the load)."""
    tp, tp_rank = _tp_coords(engine)
    name = f"restage{engine.stage_id:02d}-of-{engine.num_stages:02d}"
    if tp > 1:
        name += f"-tp{tp_rank:02d}-of-{tp:02d}"
    return root / "pipe" / name / _ZERO_TAG


def _assemble(engine, root: Path, info: dict, out: Path) -> None:
    """A one-rank hf_zero checkpoint holding exactly this stage's parameters (with tensor parallelism: this TP
    rank's pieces of them), read from the saved stages (and re-cut from the saved TP ranks' pieces). Every
    parameter is found and its shapes checked before anything is written; errors name the parameter and file."""
    pipe_root = root / "pipe"
    saved_tp = int(info.get("tp_size", 1))
    tp, tp_rank = _tp_coords(engine)
    recut = tp > 1 or saved_tp > 1
    saved_layouts = info.get("params", {})
    current_layouts = param_layout(engine.module) if tp > 1 else {}
    where: dict[str, tuple] = {}  # parameter name -> (saved stage, group, index)
    sources = []  # per saved stage, per saved TP rank: (directory, meta, rank-file handles)
    for s in range(info["num_stages"]):
        ranks = [(path, *open_saved(path)) for path in
                 (pipe_root / _stage_tag(s, r, saved_tp) / _ZERO_TAG for r in range(saved_tp))]
        sources.append(ranks)
        for gj, group in enumerate(ranks[0][1]["groups"]):
            for j, name in enumerate(group["names"]):
                where.setdefault(name, (s, gj, j))
    aliases = getattr(engine.module, "checkpoint_aliases", lambda: {})()
    tensors: dict[str, torch.Tensor] = {}
    scalar_state, param_groups = [], []
    for gi, g in enumerate(engine.groups):
        fulls: dict[str, list[torch.Tensor]] = {}
        state_src = None
        for i, name in enumerate(g.names):
            saved_name = next((n for n in (name, *aliases.get(name, ())) if n in where), None)
            if saved_name is None:
                raise CheckpointError(f"hf_zero: parameter {name!r} is in no saved pipeline stage of "
                                      f"{str(pipe_root)!r}")
            s, gj, j = where[saved_name]
            ranks = sources[s]
            cut = _recut(name, saved_name, saved_layouts, current_layouts, saved_tp, tp, tp_rank,
                         int(g.layout.numels[i]), root / "pipeline.json") if recut else None
            metas = [m for _, m, _ in ranks]
            layouts = [ShardLayout(tuple(m["groups"][gj]["numels"]), m["shard_world_size"]) for m in metas]
            keys = [k.split(".", 1)[1] for k in ranks[0][2][0].keys() if k.startswith(f"group{gj}.")]
            for key in keys:
                pieces = [_full_param_from_shards(h, f"group{gj}.{key}", layouts[r], j)
                          for r, (_, _, h) in enumerate(ranks)]
                fulls.setdefault(key, []).append(cut(pieces) if cut is not None else pieces[0])
            state_src = state_src or (metas[0], gj)
        for key, parts in fulls.items():
            if len(parts) == len(g.names):  # optimizer state exists for every parameter of the group
                tensors[f"group{gi}.{key}"] = torch.cat(parts)
        meta, gj = state_src
        scalar_state.append(meta["optimizer_scalar_state"][gj])
        param_groups.append(meta["param_groups"][gj])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / _rank_file(0)))
    first_dir, first_meta, _ = sources[0][0]
    (out / "meta.json").write_text(json.dumps({
        **first_meta, "world_size": 1, "shard_world_size": 1,
        "groups": [{"names": g.names, "numels": list(g.layout.numels)} for g in engine.groups],
        "optimizer_scalar_state": scalar_state, "param_groups": param_groups}))
    shutil.copy(first_dir / "engine_state.pt", out / "engine_state.pt")
    write_manifest(out, {name: {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
                         for name in ("meta.json", "engine_state.pt", _rank_file(0))})


def _recut(name: str, saved_name: str, saved_layouts: dict, current_layouts: dict, saved_tp: int, tp: int,
           tp_rank: int, local_numel: int, info_file: Path):
    """The function turning a parameter's saved TP pieces (flat) into this rank's flat piece; the layouts are
    checked against each other here, before any tensor is read."""
    current = current_layouts.get(name)
    saved = saved_layouts.get(saved_name)
    if saved is None and saved_tp > 1:
        raise CheckpointError(f"hf_zero: checkpoint file {str(info_file)!r} has no layout for parameter "
                              f"{saved_name!r} (saved at TP size {saved_tp})")
    saved = saved or replicated_layout(current["shape"])  # saved without TP: whole in the one piece
    current = current or replicated_layout(saved["shape"])  # loaded without TP: the whole tensor
    if list(saved["shape"]) != list(current["shape"]):
        raise CheckpointError(f"hf_zero: parameter {name!r} has shape {tuple(current['shape'])} in the model but "
                              f"{tuple(saved['shape'])} in the checkpoint ({str(info_file)!r}, saved as "
                              f"{saved_name!r})")
    full_numel = int(torch.Size(saved["shape"]).numel())

    def cut(pieces: list[torch.Tensor]) -> torch.Tensor:
        have = sum(p.numel() for p in pieces) if saved["dim"] is not None else pieces[0].numel()
        if have != full_numel:
            raise CheckpointError(f"hf_zero: parameter {saved_name!r}: the saved TP pieces under "
                                  f"{str(info_file.parent / 'pipe')!r} hold {have} elements, its shape "
                                  f"{tuple(saved['shape'])} needs {full_numel}")
        piece = piece_for(full_from_pieces(saved, pieces, saved_tp), current, tp, tp_rank)
        if piece.numel() != local_numel:
            raise CheckpointError(f"hf_zero: parameter {name!r}: this rank's piece has {piece.numel()} elements, "
                                  f"the engine holds {local_numel}")
        return piece

    return cut
