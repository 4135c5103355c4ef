"""Resuming a DeepSpeed run on hf_zero: ``engine.load_checkpoint(dir)`` on a tag DeepSpeed wrote.

A DeepSpeed tag (read whole by deepspeed_format.py) is written, for this engine, as an ordinary one-rank hf_zero
checkpoint in a private temporary directory -- this engine's optimizer groups, masters and optimizer states by
parameter name, the module's buffers and frozen parameters, counters, loss scale, LR scheduler and client_state --
which the ordinary loader then loads like any checkpoint: verified against its manifest, re-cut for this engine's
world size and ZeRO stage. DeepSpeed's world size and stage need not match this engine's.

Every name and size is checked before anything is written (errors name the parameter and the DeepSpeed file), and
the engine is changed only by the ordinary loader, after its own validation. Each rank reads the whole DeepSpeed
tag (every parameter in fp32 with its optimizer states, twice while the copy is written): a resume costs each rank
about 2 x 16 bytes per trainable parameter of host memory for the duration of the load.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf_zero.checkpoint.deepspeed_format import DeepSpeedTag, read_deepspeed_tag
from hf_zero.checkpoint.disk_format import FORMAT_VERSION, dedupe_shared, rank_file
from hf_zero.checkpoint.files import CheckpointError, sha256_file, write_manifest
from hf_zero.checkpoint.module_info import describe_module, persistent_buffers
from hf_zero.zero.saved_pieces import group_prefix

__all__ = ["convert_deepspeed_tag", "write_for_engine"]

logger = logging.getLogger("hf_zero")


def convert_deepspeed_tag(engine, tag_dir: Path, tag: str) -> Path:
    """A new private directory ``root`` whose ``root/tag`` is DeepSpeed tag ``tag_dir`` as an hf_zero checkpoint of
    ``engine`` (with ``root/latest``); the caller removes it. Nothing is left behind on error."""
    ds = read_deepspeed_tag(Path(tag_dir))
    root = Path(tempfile.mkdtemp(prefix="hf_zero-from-deepspeed-"))
    try:
        (root / tag).mkdir()
        write_for_engine(ds, engine, root / tag)
        (root / "latest").write_text(tag)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    logger.info("hf_zero: loading DeepSpeed %s checkpoint %r (ZeRO stage %d, %d ranks) into ZeRO stage %d on %d "
                "ranks", ds.ds_version, str(tag_dir), ds.stage, ds.world_size, engine.stage, engine.world_size)
    return root


def _trainable_by_name(ds: DeepSpeedTag, engine) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict[str, int]]:
    """DeepSpeed's trainable parameters as ``name -> fp32``, ``name -> {state: tensor}``, ``name -> step``. Stage 0
    saves no names: DeepSpeed's optimizer was built from the same parameter groups as this engine's, so its
    parameters are this engine's optimizer's, position by position (sizes are checked)."""
    fp32, states, steps = {}, {}, {}
    where = f"DeepSpeed checkpoint {str(ds.path)!r}"
    if ds.stage > 0:
        for g, (group, ws, ss) in enumerate(zip(ds.groups, ds.fp32, ds.states)):
            for (name, _), w, s in zip(group, ws, ss):
                fp32[name], states[name], steps[name] = w, s, ds.steps[g]
        return fp32, states, steps
    # the engine's trainable parameters per optimizer parameter group, in the order the script gave them (its
    # sharded groups split a parameter group without reordering it)
    optimizer = engine.optimizer
    engine_groups: list[list[tuple[str, torch.Size]]] = [[] for _ in optimizer.param_groups]
    for g, pg in zip(optimizer.groups, optimizer.param_group_of):
        engine_groups[pg].extend((n, torch.Size([int(k)])) for n, k in zip(g.names, g.layout.numels))
    module_shapes = {n: _shape(p) for n, p in engine.module.named_parameters()}
    engine_groups = [[(n, module_shapes.get(n, s)) for n, s in group] for group in engine_groups]
    if len(engine_groups) != len(ds.groups) and ds.groups:
        raise CheckpointError(f"hf_zero: {where} (ZeRO stage 0) has {len(ds.groups)} optimizer parameter groups, the "
                              f"engine has {len(engine_groups)}; a stage-0 checkpoint names no parameters, so they "
                              f"are matched by position: build the optimizer with the same parameter groups")
    for g, group in enumerate(engine_groups if ds.groups else []):
        group_names = [n for n, _ in group]
        shapes = [s for _, s in group]
        if len(ds.groups[g]) == 1 and ds.groups[g][0][0] is None and ds.fp32[g][0] is not None:
            flat = ds.fp32[g][0]  # one flat fp32 group (bf16/fp16 optimizer): cut by this engine's shapes
            need = sum(math.prod(s) for s in shapes)
            if flat.numel() != need:
                raise CheckpointError(f"hf_zero: {where} (ZeRO stage 0) group {g} holds {flat.numel()} fp32 elements; "
                                      f"the engine's group {g} ({group_names[:3]} ...) has {need}")
            offsets = [0]
            for s in shapes:
                offsets.append(offsets[-1] + math.prod(s))
            for i, (n, s) in enumerate(zip(group_names, shapes)):
                fp32[n] = flat[offsets[i]:offsets[i + 1]].view(s)
                states[n] = {k: v[offsets[i]:offsets[i + 1]].view(s) for k, v in ds.states[g][0].items()}
                steps[n] = ds.steps[g]
            continue
        if len(ds.groups[g]) != len(group):
            raise CheckpointError(f"hf_zero: {where} (ZeRO stage 0) group {g} has {len(ds.groups[g])} parameters, "
                                  f"the engine's has {len(group)} ({group_names[:3]} ...)")
        for n, s, st in zip(group_names, shapes, ds.states[g]):
            if n not in ds.module:
                raise CheckpointError(f"hf_zero: {where}: the model states hold no weights for {n!r}")
            bad = [k for k, v in st.items() if v.numel() != math.prod(s)]
            if bad:
                raise CheckpointError(f"hf_zero: {where} (ZeRO stage 0): optimizer state {bad[0]!r} of parameter "
                                      f"{n!r} (position {len(fp32)}) has {st[bad[0]].numel()} elements, the "
                                      f"parameter has shape {tuple(s)}")
            fp32[n], states[n], steps[n] = ds.module[n].float(), st, ds.steps[g]
    return fp32, states, steps


def _shape(p: torch.Tensor) -> torch.Size:
    ds_shape = getattr(p, "ds_shape", None)  # a ZeRO-3 parameter's data is a placeholder
    return torch.Size(ds_shape) if ds_shape is not None else p.shape


def write_for_engine(ds: DeepSpeedTag, engine, out: Path) -> None:
    """Write ``ds`` into ``out`` as a one-rank hf_zero checkpoint of ``engine``'s groups (checked first)."""
    where = f"DeepSpeed checkpoint {str(ds.path)!r}"
    fp32, states, steps = _trainable_by_name(ds, engine)
    aliases = {**ds.shared, **{v: k for k, v in ds.shared.items()}}  # tied names, either way round

    def lookup(table: dict, name: str):
        return table[name] if name in table else table.get(aliases.get(name, "\0"))

    tensors: dict[str, torch.Tensor] = {}
    groups, scalar_state = [], []
    for gi, g in enumerate(engine.optimizer.groups):
        if getattr(g, "expert", None) is not None:
            raise CheckpointError(f"hf_zero: {where}: loading a DeepSpeed checkpoint into an engine with "
                                  f"expert-parallel MoE groups is not supported")
        numels = [int(n) for n in g.layout.numels]
        masters, kept_states, group_steps = [], None, set()
        for name, numel in zip(g.names, numels):
            w = lookup(fp32, name)
            if w is None:
                raise CheckpointError(f"hf_zero: {where} holds no trainable parameter {name!r} (it has "
                                      f"{sorted(fp32)[:5]} ...); the model or its frozen parameters differ")
            if w.numel() != numel:
                raise CheckpointError(f"hf_zero: {where}: parameter {name!r} has {w.numel()} elements "
                                      f"(shape {tuple(w.shape)}), the engine's has {numel}")
            masters.append(w.reshape(-1))
            st = lookup(states, name) or {}
            kept_states = set(st) if kept_states is None else kept_states & set(st)
            if lookup(steps, name) is not None:
                group_steps.add(lookup(steps, name))
        prefix = group_prefix(gi, None)
        tensors[f"{prefix}master"] = torch.cat(masters) if masters else torch.zeros(0)
        for key in sorted(kept_states or ()):  # per-element states every parameter of the group has
            tensors[f"{prefix}state.{key}"] = torch.cat([lookup(states, n)[key].reshape(-1) for n in g.names])
        groups.append({"names": list(g.names), "numels": numels})
        scalar_state.append({"step": max(group_steps)} if kept_states and group_steps else {})
    master_dtypes = {prefix + "master": dtype for prefix, _, _, dtype in engine.optimizer.shard_layouts()}
    tensors = {k: v.to(master_dtypes.get(k, torch.float32)) for k, v in tensors.items()}
    if engine.stage3 is not None:
        tensors.update(_stage3_extras(ds, engine, where))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / rank_file(0)))
    written = [rank_file(0), "meta.json", "engine_state.pt"]
    if engine.stage3 is None:
        sd, tied = dedupe_shared(_module_state(ds, engine, fp32, where))
        save_file(sd, str(out / "model.safetensors"), metadata={"aliases": json.dumps(tied)})
        written.append("model.safetensors")
    current = engine.optimizer.scalar_state()["param_groups"]
    if len(ds.param_groups) == len(current):  # DeepSpeed's hyper-parameters, for the keys this optimizer has
        param_groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in saved.items() if k in now}
                        for saved, now in zip(ds.param_groups, current)]
    else:
        logger.warning("hf_zero: %s has %d optimizer parameter groups, the engine %d: the engine keeps its own "
                       "learning rates and hyper-parameters", where, len(ds.param_groups), len(current))
        param_groups = current
    (out / "meta.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION, "world_size": 1, "stage": 3 if engine.stage3 is not None else engine.stage,
        "groups": groups, "shard_world_size": 1, "optimizer_scalar_state": scalar_state,
        "param_groups": param_groups, "global_steps": ds.global_steps, "module": describe_module(engine.module),
        "source": f"deepspeed {ds.ds_version}: {ds.path}"}, indent=1))
    torch.save({
        "global_steps": ds.global_steps, "global_samples": ds.global_samples,
        "micro_steps": ds.global_steps * engine.gradient_accumulation_steps(), "skipped_steps": ds.skipped_steps,
        "loss_scaler": _loss_scaler_state(ds, engine), "lr_scheduler": ds.lr_scheduler,
        "client_state": ds.client_state, "config": dict(engine.config),
    }, out / "engine_state.pt")
    # checksummed so the ordinary loader verifies the copy like any checkpoint; not fsynced (a temporary file)
    write_manifest(out, {n: {"bytes": (out / n).stat().st_size, "sha256": sha256_file(out / n)} for n in written})


def _frozen(ds: DeepSpeedTag, name: str) -> torch.Tensor | None:
    """A frozen parameter's whole value: stage 3 saves its pieces (gathered by the reader), stages 0-2 the module."""
    if name in ds.frozen:
        return ds.frozen[name]
    value = ds.module.get(name)
    return value if value is not None and value.numel() > 0 else None


def _module_state(ds: DeepSpeedTag, engine, fp32: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The module's state dict for model.safetensors: trainable weights from the fp32 masters, frozen parameters and
    buffers as DeepSpeed saved them; a name DeepSpeed did not save is left out (the strict load names it)."""
    sd = {}
    for name, value in engine.module.state_dict().items():
        saved = fp32.get(name)
        if saved is None:
            saved = _frozen(ds, name)
        if saved is None and name in ds.shared:
            saved = fp32.get(ds.shared[name])
        if saved is None:
            continue
        if saved.numel() != value.numel():
            raise CheckpointError(f"hf_zero: {where}: {name!r} has shape {tuple(saved.shape)}, the model's "
                                  f"{tuple(value.shape)}")
        sd[name] = saved.reshape(value.shape).to(value.dtype)
    return sd


def _stage3_extras(ds: DeepSpeedTag, engine, where: str) -> dict[str, torch.Tensor]:
    """A ZeRO-3 engine's frozen parameters (flat, whole: a one-rank shard) and persistent buffers."""
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            continue
        value = _frozen(ds, name)
        if value is None:
            raise CheckpointError(f"hf_zero: {where} holds no value for the frozen parameter {name!r}")
        out[f"stage3.frozen.{name}"] = value.reshape(-1)
    for name, buf in persistent_buffers(engine.module):
        if name in ds.module and ds.module[name].numel() == buf.numel():
            out[f"stage3.buffer.{name}"] = ds.module[name].reshape(buf.shape)
    return out


def _loss_scaler_state(ds: DeepSpeedTag, engine) -> dict | None:
    """DeepSpeed's loss scaler as hf_zero's: the scale, the good steps since the last overflow, hysteresis."""
    if engine.loss_scaler is None or not ds.loss_scaler or "cur_scale" not in ds.loss_scaler:
        return None
    s = ds.loss_scaler
    own = engine.loss_scaler.state_dict()
    good = int(s.get("cur_iter", 0)) - int(s.get("last_overflow_iter", -1)) - 1
    return {"scale": float(s["cur_scale"]), "good_steps": max(0, good),
            "hysteresis_left": int(s.get("cur_hysteresis", own["hysteresis_left"]))}
