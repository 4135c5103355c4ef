"""Pipeline checkpoints that reload on another number of stages (and data-parallel replicas, and ZeRO stage).

    <dir>/latest                                  the tag
    <dir>/<tag>/pipeline.json                     stages, data-parallel size, layer boundaries at save time
    <dir>/<tag>/layer_05-model_states.pt          DeepSpeed's per-layer module files (the weights of layer 5)
    <dir>/<tag>/pipe/stage01/zero/...             stage 1's ordinary hf_zero checkpoint (masters, optimizer state
                                                  shards, counters, scheduler), written by its replicas (each stage
                                                  under its own root: the saver cleans stale files in its root)

Parameters are named by the model, not by the stage (``3.weight``: layer 3 wherever it runs; HF names for a
wrapped HF model), so a stage of a different cut finds each of its parameters in whichever saved stage held it.
Loading with the same stages reads the stage's own checkpoint; otherwise the stage's replicas assemble a one-rank
checkpoint of exactly their parameters (full masters and optimizer states, from the saved shards) and load that
through the ordinary loader, which re-cuts it for the current replicas and ZeRO stage.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from hf_zero.runtime.checkpoint import (_full_param_from_shards, _rank_file, load_checkpoint, read_latest_tag,
                                        save_checkpoint)
from hf_zero.runtime.checkpoint_files import sha256_file, write_manifest
from hf_zero.zero.layout import ShardLayout

__all__ = ["save_pipeline_checkpoint", "load_pipeline_checkpoint"]


_ZERO_TAG = "zero"


def _stage_tag(stage: int) -> str:
    return f"stage{stage:02d}"


def save_pipeline_checkpoint(engine, save_dir, *, tag=None, client_state=None, save_latest: bool = True) -> bool:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    root = Path(save_dir) / tag
    grid = engine.grid
    # every stage's replicas write their own ordinary checkpoint, side by side
    save_checkpoint(engine, root / "pipe" / _stage_tag(engine.stage_id), tag=_ZERO_TAG,
                    client_state=client_state or {}, save_latest=False, exclude_frozen_parameters=False)
    if grid.data_parallel_id == 0:
        layers = engine.module.layer_state_dicts()
        if engine.stage3 is not None:
            from hf_zero.zero.gathered import GatheredParameters

            with GatheredParameters(list(engine.module.parameters())):
                layers = {i: {k: v.clone() for k, v in sd.items()} for i, sd in
                          engine.module.layer_state_dicts().items()}
        for idx, sd in layers.items():
            torch.save({k: v.detach().cpu() for k, v in sd.items()}, root / f"layer_{idx:02d}-model_states.pt")
    elif engine.stage3 is not None:  # the gather above is collective over the replicas
        from hf_zero.zero.gathered import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            pass
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "pipeline.json").write_text(json.dumps({
            "num_stages": engine.num_stages, "data_parallel_size": grid.data_parallel_size,
            "parts": list(getattr(engine.module, "parts", [])), "virtual_stages": engine.module.virtual_stages}))
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)
    dist.barrier()
    return True


def load_pipeline_checkpoint(engine, load_dir, *, tag=None, load_optimizer_states: bool = True,
                             load_lr_scheduler_states: bool = True, load_module_strict: bool = True):
    tag = tag if tag is not None else read_latest_tag(load_dir)
    if tag is None:
        return None, None
    root = Path(load_dir) / str(tag)
    info_path = root / "pipeline.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"hf_zero: {str(root)!r} is not a pipeline checkpoint (no pipeline.json)")
    info = json.loads(info_path.read_text())
    if info["num_stages"] == engine.num_stages:
        return load_checkpoint(engine, root / "pipe" / _stage_tag(engine.stage_id), tag=_ZERO_TAG,
                               load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states)
    grid = engine.grid
    merged = root / "pipe" / f"restage{engine.stage_id:02d}-of-{engine.num_stages:02d}" / _ZERO_TAG
    if grid.data_parallel_id == 0:
        _assemble(engine, root / "pipe", info["num_stages"], merged)
    dist.barrier()
    try:
        return load_checkpoint(engine, merged.parent, tag=merged.name, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states)
    finally:
        dist.barrier()
        if grid.data_parallel_id == 0:
            shutil.rmtree(merged.parent, ignore_errors=True)


def _assemble(engine, pipe_root: Path, saved_stages: int, out: Path) -> None:
    """A one-rank hf_zero checkpoint holding exactly this stage's parameters, read from the saved stages."""
    where: dict[str, tuple] = {}  # parameter name -> (saved stage, group, index)
    sources = []
    for s in range(saved_stages):
        path = pipe_root / _stage_tag(s) / _ZERO_TAG
        meta = json.loads((path / "meta.json").read_text())
        handles = [safe_open(str(path / _rank_file(r)), "pt") for r in range(meta["shard_world_size"])]
        sources.append((path, meta, handles))
        for gj, group in enumerate(meta["groups"]):
            for j, name in enumerate(group["names"]):
                where.setdefault(name, (s, gj, j))
    aliases = getattr(engine.module, "checkpoint_aliases", lambda: {})()
    tensors: dict[str, torch.Tensor] = {}
    scalar_state, param_groups = [], []
    for gi, g in enumerate(engine.groups):
        fulls: dict[str, list[torch.Tensor]] = {}
        state_src = None
        for name in g.names:
            found = where.get(name) or next((where[a] for a in aliases.get(name, ()) if a in where), None)
            if found is None:
                raise KeyError(f"hf_zero: parameter {name!r} is in no saved pipeline stage of {str(pipe_root)!r}")
            s, gj, j = found
            _, meta, handles = sources[s]
            layout = ShardLayout(tuple(meta["groups"][gj]["numels"]), meta["shard_world_size"])
            keys = [k.split(".", 1)[1] for k in handles[0].keys() if k.startswith(f"group{gj}.")]
            for key in keys:
                fulls.setdefault(key, []).append(_full_param_from_shards(handles, f"group{gj}.{key}", layout, j))
            state_src = state_src or (meta, gj)
        for key, parts in fulls.items():
            if len(parts) == len(g.names):  # optimizer state exists for every parameter of the group
                tensors[f"group{gi}.{key}"] = torch.cat(parts)
        meta, gj = state_src
        scalar_state.append(meta["optimizer_scalar_state"][gj])
        param_groups.append(meta["param_groups"][gj])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / _rank_file(0)))
    first_meta = sources[0][1]
    (out / "meta.json").write_text(json.dumps({
        **first_meta, "world_size": 1, "shard_world_size": 1,
        "groups": [{"names": g.names, "numels": list(g.layout.numels)} for g in engine.groups],
        "optimizer_scalar_state": scalar_state, "param_groups": param_groups}))
    shutil.copy(sources[0][0] / "engine_state.pt", out / "engine_state.pt")
    write_manifest(out, {name: {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
                         for name in ("meta.json", "engine_state.pt", _rank_file(0))})
