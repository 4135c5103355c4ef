"""Engine checkpoints: written atomically, tensors in safetensors, loadable on any world size.

Layout of ``save_dir``::

    latest                          the newest complete tag (replaced atomically)
    zero_to_fp32.py                 DeepSpeed's offline converter's command line, calling hf_zero's (zero_to_fp32.py)
    <tag>/meta.json                 world size, stage, per group: parameter names and numels; scalar optimizer state;
                                    the module's shapes, tied names, frozen parameters, buffers (module_info.py)
    <tag>/model.safetensors         rank 0: the model's state dict (stages 0-2; whole parameters on every rank)
    <tag>/zero_rank00003.safetensors  rank 3: fp32 master shard and optimizer-state shards of every group, RNG state
    <tag>/engine_state.pt           rank 0: counters, loss scaler, LR and curriculum schedulers, client_state (loaded
                                    weights_only)

Atomicity (commit.py): every rank writes into ``.tmp-<tag>``; the ranks agree (one bounded
all-gather) that all writes succeeded; only then rank 0 renames the directory into place and rewrites ``latest``.
A crash or error part-way leaves the previous checkpoint and ``latest`` untouched; a leftover ``.tmp-*`` directory
is ignored and replaced by the next save.

Resharding: shards follow :class:`~hf_zero.zero.layout.ShardLayout` (each parameter split into one shard per
rank), so a checkpoint written on N ranks is re-cut for M ranks at load time from the per-parameter shards -- no
offline converter.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_zero import comm
from hf_zero.checkpoint.commit import agree, check_tag, commit_tag
from hf_zero.checkpoint.deepspeed_format import is_deepspeed_tag, is_universal_tag
from hf_zero.checkpoint.disk_format import (FORMAT_VERSION, dedupe_shared, open_shard_file, rank_file,
                                            read_latest_tag, read_model_file)
from hf_zero.checkpoint.files import (MANIFEST, CheckpointError, check_client_state, file_entry, read_json,
                                      read_manifest, resolve_checkpoint, torch_load, verify_files)
from hf_zero.checkpoint.from_deepspeed import convert_deepspeed_tag
from hf_zero.checkpoint.module_info import describe_module, persistent_buffers, write_recovery_script
from hf_zero.checkpoint.placement import agree_on_tag, describe_ranks, place
from hf_zero.checkpoint.reshard import ShardFiles
from hf_zero.tensor_parallel import tp_info
from hf_zero.zero.layout import ShardLayout
from hf_zero.zero.saved_pieces import SavedPieces

__all__ = ["save_checkpoint", "load_checkpoint", "save_16bit_model", "read_latest_tag"]

logger = logging.getLogger("hf_zero")

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _write_rank_files(engine, tmp: Path, exclude_frozen: bool, client_state: dict, is_writer: bool,
                      write_model: bool = True, module_state: dict | None = None,
                      recovery_script: bool = False) -> dict[str, dict[str, Any]]:
    """Write this rank's files into ``tmp``, fsynced; returns their manifest entries (size, sha256). The writer
    with ``recovery_script`` also replaces ``zero_to_fp32.py`` beside the tags (not in the tag: no manifest entry)."""
    names = _write_rank_files_unsynced(engine, tmp, exclude_frozen, client_state, is_writer, write_model,
                                       module_state)
    if is_writer and recovery_script:
        write_recovery_script(tmp.parent)
    return {name: file_entry(tmp / name) for name in names}


def _write_rank_files_unsynced(engine, tmp: Path, exclude_frozen: bool, client_state: dict, is_writer: bool,
                               write_model: bool = True, module_state: dict | None = None) -> list[str]:
    """The file layout. Each component names its own state; this decides which file holds it:

    * this rank's ``zero_rank<r>.safetensors``: the optimizer's shards (masters, moments), the stage-3 runtime's
      shards (frozen parameters, buffers), ZenFlow's state, the CPU RNG state;
    * the directory writer's (rank 0's; with node-local storage, each node's first rank's) ``meta.json``: the
      optimizer's scalar state and group description, sizes;
    * its ``engine_state.pt``: counters, skipped steps, the loss scaler's, the LR scheduler's and the legacy
      curriculum scheduler's state dicts (each once), ``client_state``;
    * its ``model.safetensors`` (stages 0-2): the module's state dict -- unless ``write_model`` is false (a 3D
      pipeline keeps its module in per-layer files: hf_zero/checkpoint/pipeline.py); ``module_state`` if
      given (a tensor-parallel module's state dict, gathered by the caller before any write can fail: the gather
      is a collective over the TP group), at stage 3 too (the unsplit model a TP checkpoint re-cuts from).

    Unsharded optimizer state (stage 0: identical on every rank) is ``zero_rank00000``'s; a node-local directory
    without rank 0 gets its own copy of that file from its writer (without rank 0's RNG state).
    """
    rank = engine.global_rank
    optimizer = engine.optimizer
    scalars = optimizer.scalar_state()
    tensors: dict[str, torch.Tensor] = {"rng.cpu": torch.get_rng_state()}
    unsharded = scalars["shard_world_size"] == 1
    # expert-parallel groups' pieces: each written by the first rank holding it (keys name the EP rank)
    tensors.update(optimizer.shard_state(dense=not unsharded or rank == 0))
    if engine.stage3 is not None:
        tensors.update(engine.stage3.shard_state(exclude_frozen=exclude_frozen))
    if getattr(engine, "zenflow", None) is not None:  # its selective state (hf_zero/zero/zenflow.py)
        tensors.update(engine.zenflow.state_tensors())
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp / rank_file(rank)))
    if not is_writer:
        return [rank_file(rank)]
    written = [rank_file(rank), "meta.json", "engine_state.pt"]
    if unsharded and rank != 0:
        save_file({k: v.detach().contiguous() for k, v in optimizer.shard_state(experts=False).items()},
                  str(tmp / rank_file(0)))
        written.append(rank_file(0))
    if write_model and (engine.stage3 is None or module_state is not None):
        sd, aliases = dedupe_shared(module_state if module_state is not None else
                                     engine.module_state_dict(exclude_frozen))
        save_file(sd, str(tmp / "model.safetensors"), metadata={"aliases": json.dumps(aliases)})
        written.append("model.safetensors")
    meta = {"format_version": FORMAT_VERSION, "world_size": engine.world_size, "stage": engine.stage,
            **{k: v for k, v in scalars.items() if k != "skipped_steps"}, "global_steps": engine.global_steps,
            "module": describe_module(engine.module), **_expert_layers_entry(engine)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    curriculum = getattr(engine, "curriculum_scheduler_legacy", None)
    torch.save({
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps, "skipped_steps": scalars["skipped_steps"],
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "curriculum_scheduler": curriculum.state_dict() if curriculum is not None else None,
        "random_ltd": (engine.random_ltd_scheduler.state_dict()
                       if getattr(engine, "random_ltd_scheduler", None) is not None else None),
        "client_state": client_state,
        "config": dict(engine.config),
    }, tmp / "engine_state.pt")
    return written


def _expert_layers_entry(engine) -> dict:
    """meta.json's ``expert_parallel``: each expert-parallel MoE layer's expert prefix, ep_size and experts per
    rank -- what the offline converter needs to name every expert by its global index (disk_format.expert_layers)."""
    if not getattr(engine, "_expert_groups", None):
        return {}
    from hf_zero.moe.state import expert_parallel_layers

    return {"expert_parallel": [{"prefix": prefix, "ep_size": layer.ep_size,
                                 "num_local_experts": layer.num_local_experts}
                                for prefix, layer in expert_parallel_layers(engine.module)]}


def save_checkpoint(engine, save_dir, *, tag=None, client_state: dict, save_latest: bool,
                    exclude_frozen_parameters: bool, write_model: bool = True,
                    module_state: dict | None = None, recovery_script: bool = True) -> bool:
    """Write a checkpoint on every rank (collective). Raises, leaving the previous checkpoint intact, on failure
    (:class:`~hf_zero.checkpoint.commit.SaveError` on every rank, naming the rank that failed).

    Each directory (the shared one, or with ``checkpoint.use_node_local_storage`` each node's own: see
    placement.py) gets the files of the ranks that see it, and is finalized by its writer rank; ``latest``
    moves only after every directory holds its complete, renamed tag (commit.py).

    ``recovery_script``: the writer also puts ``zero_to_fp32.py`` into the directory, as part of the save (its
    failure fails the save on every rank); false for the parts of a composite checkpoint (pipeline, tensor
    parallel), which the offline converter does not read."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    check_tag(tag)
    check_client_state(client_state)  # refused here, not at resume time after the weights were overwritten
    root = Path(save_dir)
    group = engine.process_group
    if module_state is None and write_model and engine.stage3 is None and getattr(engine, "_expert_groups", None):
        # expert parallelism: the model file holds every rank's experts under their global indices, gathered here,
        # on every rank, before any write can fail (a collective over each expert-parallel group)
        from hf_zero.moe.state import global_state_dict

        module_state = global_state_dict(engine.module, engine.module_state_dict(exclude_frozen_parameters))
    what = f"save_checkpoint({str(root)!r}, tag={tag!r})"  # for errors; collectives' labels name no path (with
    label = f"save_checkpoint(tag={tag!r})"                   # node-local storage it may differ between nodes)
    spot = place(engine.global_rank, engine.world_size, root, engine.use_node_local_storage(),
                 lambda mine, w: _agree(engine, mine, w), lambda w: comm.barrier(group, what=w), what, label)
    commit_tag(root, tag, is_writer=spot.is_writer, domain=spot.domain,
               me=describe_ranks([engine.global_rank], spot.nodes),
               agree=lambda mine, w: _agree(engine, mine, w), barrier=lambda w: comm.barrier(group, what=w),
               write=lambda tmp: (_write_rank_files(engine, tmp, exclude_frozen_parameters, client_state,
                                                    spot.is_writer, write_model, module_state,
                                                    recovery_script=recovery_script), None),
               save_latest=save_latest, what=what, label=label)
    return True


def _agree(engine, mine: Any, what: str) -> list[Any]:
    """Every rank's ``mine`` (a small picklable value), gathered on every rank within comms_timeout_s."""
    if engine.world_size == 1:
        return [mine]
    return agree(mine, what, engine.process_group)


def load_checkpoint(engine, load_dir, *, tag=None, load_module_strict: bool, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, load_module_weights: bool = True, universal: bool = False):
    """Restore a checkpoint (any saved world size). Returns ``(path, client_state)``, or ``(None, None)``.

    ``load_module_weights=False``: the caller has loaded the module (a tensor-parallel model's full weights are
    sliced into its DTensors by hf_zero/checkpoint/tp.py). ``universal`` (``checkpoint.load_universal``): the tag
    is a DeepSpeed universal checkpoint, named by ``latest_universal`` (what ds_to_universal writes)."""
    root = Path(load_dir)
    latest_name = "latest_universal" if universal else "latest"
    # every rank loads the same tag, or none does (a node whose 'latest' differs is named, not mixed in)
    tag = agree_on_tag(engine.global_rank, engine.world_size, root, tag,
                       lambda r: read_latest_tag(r, latest_name), lambda mine, w: _agree(engine, mine, w))
    if tag is None:
        logger.warning("hf_zero: load_checkpoint(%r): no %r file and no tag given; nothing loaded", str(root),
                       latest_name)
        return None, None
    if universal and not is_universal_tag(root / str(tag)):
        raise CheckpointError(f"hf_zero: checkpoint.load_universal is true, but {str(root / str(tag))!r} is not a "
                              f"DeepSpeed universal checkpoint (no zero/optimizer_state.pt; ds_to_universal writes "
                              f"one); set checkpoint.load_universal to false to load an ordinary checkpoint")
    load = _load_deepspeed_tag if is_deepspeed_tag(root / str(tag)) else _load_tag  # DeepSpeed's: a converted copy
    return load(engine, root, str(tag), load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_weights=load_module_weights)


def _agree_or_raise(engine, error: Exception | None, what: str) -> None:
    """Every rank learns whether every rank got this far without ``error`` (one bounded all-gather); a rank's own
    error is raised as is, another rank's as a CheckpointError naming it -- on every rank, before any change."""
    reports = _agree(engine, None if error is None else str(error), what)
    if error is not None:
        raise error
    failed = [r for r, msg in enumerate(reports) if msg is not None]
    if failed:
        raise CheckpointError(f"hf_zero: load_checkpoint failed on rank {failed[0]} (nothing was changed): "
                              f"{reports[failed[0]]}")


def _load_tag(engine, root: Path, tag: str, *, load_module_strict: bool, load_optimizer_states: bool,
              load_lr_scheduler_states: bool, load_module_weights: bool):
    """load_checkpoint of hf_zero tag ``root/tag``, which every rank agreed on."""
    # 1. validate everything on every rank; 2. agree; 3. only then change tensors and counters
    error: Exception | None = None
    try:
        path, meta, engine_state, sd, handles = _validate(engine, root, str(tag), load_module_strict,
                                                          read_model=load_module_weights)
    except (CheckpointError, ValueError) as exc:
        error = exc
    _agree_or_raise(engine, error, f"the agreement of load_checkpoint({tag!r})")
    reader = ShardFiles(handles, SavedPieces.of(meta))
    if sd is not None and load_module_weights:
        engine.module.load_state_dict(sd, strict=load_module_strict)
    if engine.stage3 is None and meta.get("stage") == 3:
        _restore_stage3_extras(engine, reader)
    try:
        if engine.stage3 is not None:
            engine.stage3.load_shard_state(reader)
        engine.optimizer.load_shard_state(reader, optimizer_states=load_optimizer_states)
        if load_optimizer_states:
            engine.optimizer.load_scalar_state({**meta, "skipped_steps": engine_state["skipped_steps"]})
            zenflow = getattr(engine, "zenflow", None)
            if zenflow is not None and not zenflow.load_state(reader):
                logger.warning("hf_zero: the checkpoint %s has no ZenFlow state (saved without "
                               "zero_optimization.zenflow): its selective optimizer starts afresh and chooses its "
                               "columns at the next backward", path)
    finally:
        del reader, handles
    engine.optimizer.publish()
    if getattr(engine, "zenflow", None) is not None:  # its weights are not all the masters (zero/zenflow.py)
        engine.zenflow.restore_weights()
    own_file = path / rank_file(engine.global_rank)
    if meta["world_size"] == engine.world_size and own_file.is_file():  # RNG streams only resume on the same ranks
        with safe_open(str(own_file), "pt") as f:
            if "rng.cpu" in f.keys():
                torch.set_rng_state(f.get_tensor("rng.cpu"))
    engine.global_steps = engine_state["global_steps"]
    engine.global_samples = engine_state["global_samples"]
    engine.micro_steps = engine_state["micro_steps"]
    if load_optimizer_states and engine.loss_scaler is not None and engine_state["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(engine_state["loss_scaler"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and engine_state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(engine_state["lr_scheduler"])
    # the curriculum's difficulty follows global_steps, restored above whatever the load flags (older checkpoints
    # have no entry: the next forward recomputes it from the step)
    curriculum = getattr(engine, "curriculum_scheduler_legacy", None)
    if curriculum is not None and engine_state.get("curriculum_scheduler") is not None:
        curriculum.load_state_dict(engine_state["curriculum_scheduler"])
    ltd = getattr(engine, "random_ltd_scheduler", None)  # random-LTD's reserved length and consumed layer tokens
    if ltd is not None and engine_state.get("random_ltd") is not None:
        ltd.load_state_dict(engine_state["random_ltd"])
    comm.barrier(engine.process_group, what="the end of load_checkpoint")
    return str(path), engine_state["client_state"]


def _load_deepspeed_tag(engine, root: Path, tag: str, **load_args):
    """Load a tag DeepSpeed wrote: every rank converts it into a private hf_zero copy (from_deepspeed.py), the ranks
    agree that all conversions succeeded (a rank that cannot read a file is named on every rank), then the copy
    loads like any checkpoint and is removed."""
    copy, error = None, None
    try:
        copy = convert_deepspeed_tag(engine, root / tag, tag)
    except (CheckpointError, ValueError) as exc:
        error = exc
    try:
        _agree_or_raise(engine, error, f"the reading of DeepSpeed checkpoint tag {tag!r}")
        path, client_state = _load_tag(engine, copy, tag, **load_args)
        return str(root / tag) if path is not None else None, client_state  # the caller's directory, not the copy
    finally:
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)


def _validate(engine, root: Path, tag: str, strict: bool, read_model: bool = True):
    """Everything a load reads, checked before anything changes: files present and matching their checksums,
    groups, shapes and dtypes; returns ``(path, meta, engine_state, model_state_dict | None, handles)``.
    ``read_model=False``: the caller loads the module from elsewhere (model.safetensors is neither read nor
    required)."""
    path = resolve_checkpoint(root, tag)
    if not (path / "meta.json").is_file():
        present = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise CheckpointError(f"hf_zero: checkpoint {str(path)!r} is missing or incomplete (no meta.json); "
                              f"tags present: {present}")
    manifest = read_manifest(path)
    meta = read_json(path / "meta.json")
    reads = _shard_files_read(engine, path, meta, manifest)
    rank_names = {r: rank_file(r) for r in reads}
    if manifest is not None:
        verify_files(path, manifest, ["meta.json", "engine_state.pt", *rank_names.values()] +
                     (["model.safetensors"] if "model.safetensors" in manifest else []))
    else:
        logger.warning("hf_zero: checkpoint %r has no %s (saved before checksums); loading it unverified",
                       str(path), MANIFEST)
    _check_groups(engine.optimizer.scalar_state()["groups"], meta, path)
    state = torch_load(path / "engine_state.pt")
    handles = {r: open_shard_file(path / name) for r, name in rank_names.items()}
    pieces = SavedPieces.of(meta)
    for prefix, layout, _, dtype in engine.optimizer.shard_layouts():
        saved_layout = pieces.layout(prefix, layout.numels)
        if pieces.missing(prefix):
            raise CheckpointError(f"hf_zero: checkpoint {str(path)!r} holds no shards {prefix}* of this rank's "
                                  "experts (saved without expert parallelism, or with another ep_size)")
        for r, h in handles.items():
            for key in (k for k in h.keys() if k.startswith(prefix)):
                sl = h.get_slice(key)
                # the master is in the master dtype; optimizer states may differ from it (fp32 moments beside bf16
                # masters, bf16.bf16_optimizer_states false) and load into the engine's state dtype
                ok = ({_ST_DTYPES[dtype]} if key == prefix + "master" else set(_ST_DTYPES.values()))
                if list(sl.get_shape()) != [saved_layout.shard_numel] or sl.get_dtype() not in ok:
                    raise CheckpointError(
                        f"hf_zero: checkpoint file {str(path / rank_names[r])!r}: {key} has shape {sl.get_shape()} "
                        f"and dtype {sl.get_dtype()}; the saved layout needs [{saved_layout.shard_numel}] "
                        f"{' or '.join(sorted(ok))}")
    sd = None
    buffers = [n for n, _ in persistent_buffers(engine.module)]
    frozen = [n for n, p in engine.module.named_parameters() if not p.requires_grad]
    saved_stage = int(meta.get("stage", 0))
    if engine.stage3 is None and saved_stage < 3:
        model_file = path / "model.safetensors"
        if not read_model:
            pass
        elif model_file.is_file():
            sd = _read_model_file(model_file, engine, strict)
        elif buffers or frozen:
            raise CheckpointError(f"hf_zero: checkpoint file {str(model_file)!r} is missing; it holds the model's "
                                  f"buffers and frozen parameters ({(buffers + frozen)[:5]} ...)")
    elif engine.stage3 is None:  # a ZeRO-3 checkpoint into a stage 0-2 engine: buffers and frozen from the shards
        keys = set(next(iter(handles.values())).keys()) if handles else set()
        missing = [n for n in buffers if f"stage3.buffer.{n}" not in keys] + \
                  [n for n in frozen if f"stage3.frozen.{n}" not in keys]
        if missing:
            raise CheckpointError(f"hf_zero: checkpoint file {str(path / rank_names[0])!r} (ZeRO-3) has no saved "
                                  f"values for {missing[:5]} (buffers / frozen parameters of this model)")
    elif saved_stage < 3 and (buffers or frozen):
        raise CheckpointError(
            f"hf_zero: checkpoint {str(path)!r} was saved at ZeRO stage {saved_stage}: its buffers and frozen "
            f"parameters ({(buffers + frozen)[:5]}) are in model.safetensors, which a ZeRO-3 engine does not read. "
            f"Load it with a stage 0-2 engine and save again, or load the weights with from_pretrained first.")
    return path, meta, state, sd, handles


def _shard_files_read(engine, path: Path, meta: dict, manifest: dict | None) -> list[int]:
    """The saved ranks whose shard files this rank reads: all of them where the directory holds them all (a shared
    directory: also what a re-cut needs), else -- a node-local copy -- only the one its own shards are, which needs
    the same layout as at save. A file that is not here is a CheckpointError naming it, the rank and the node."""

    def here(r: int) -> bool:
        return rank_file(r) in manifest if manifest is not None else (path / rank_file(r)).is_file()

    pieces = SavedPieces.of(meta)
    everything = pieces.all_ranks()
    if all(here(r) for r in everything):
        return everything
    layouts = engine.optimizer.shard_layouts()
    # the files of this rank's pieces (an expert group's: of the saved rank that held it, as meta.json names)
    own = sorted({pieces.file_of(prefix, r) for prefix, _, r, _ in layouts}
                 | ({engine.stage3.rank} if engine.stage3 is not None else set()))
    same_layout = (all(pieces.layout(prefix, layout.numels) == layout for prefix, layout, _, _ in layouts)
                   and not (engine.stage3 is None and int(meta.get("stage", 0)) == 3))
    needed = own if same_layout else everything
    missing = [r for r in needed if not here(r)]
    if not missing:
        return needed
    held = [r for r in everything if here(r)]
    why = (f"this directory holds the shards of saved rank{'s' if len(held) != 1 else ''} {held} only (saved with "
           f"checkpoint.use_node_local_storage, or into per-rank directories: each directory keeps the files of the "
           f"ranks that wrote there)")
    if same_layout:
        fix = ("load on the same nodes and ranks as the save (this rank's shards were written on another node), or "
               "copy every node's zero_rank*.safetensors of this tag into each node's directory")
    else:
        fix = (f"the checkpoint was saved on {meta.get('world_size')} ranks and is loaded on {engine.world_size} "
               f"(or at another ZeRO stage): re-cutting its shards needs every rank's file, so copy every node's "
               f"zero_rank*.safetensors of this tag into one directory")
    raise CheckpointError(f"hf_zero: load_checkpoint: rank {engine.global_rank} (node {comm.get_node_id()!r}) "
                          f"needs checkpoint file {str(path / rank_file(missing[0]))!r}, which is not on this node: "
                          f"{why}; {fix}. Nothing was loaded.")


def _read_model_file(model_file: Path, engine, strict: bool) -> dict[str, torch.Tensor]:
    sd = read_model_file(model_file)
    if getattr(engine, "_expert_groups", None):  # saved under global expert indices: this rank's experts
        from hf_zero.moe.state import local_state_dict

        sd = local_state_dict(engine.module, sd)
    current = engine.module.state_dict()
    missing = [k for k in current if k not in sd]
    unexpected = [k for k in sd if k not in current]
    if strict and (missing or unexpected):
        raise CheckpointError(f"hf_zero: checkpoint file {str(model_file)!r} does not match the model: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]} (load_module_strict=False to allow)")
    bad = [f"{k} (saved {tuple(v.shape)}, model {tuple(current[k].shape)})" for k, v in sd.items()
           if k in current and tuple(v.shape) != tuple(current[k].shape)]
    if bad:
        raise CheckpointError(f"hf_zero: checkpoint file {str(model_file)!r}: shapes differ from the model: {bad[:5]}")
    return sd


def _restore_stage3_extras(engine, reader: ShardFiles) -> None:
    """Buffers and frozen parameters of a ZeRO-3 checkpoint into a stage 0-2 engine (whole parameters)."""
    with torch.no_grad():
        for name, buf in persistent_buffers(engine.module):
            buf.copy_(reader.whole(f"stage3.buffer.{name}"))
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                whole = reader.shard(f"stage3.frozen.{name}", ShardLayout((p.numel(),), 1), 0)
                p.copy_(whole.view_as(p))


def _check_groups(current: list[dict], meta: dict, path: Path) -> None:
    """The optimizer's groups (names and numels) as saved and as now: shards re-cut only between equal groups."""
    saved = meta["groups"]
    if len(saved) != len(current):
        raise ValueError(f"hf_zero: checkpoint {str(path)!r} has {len(saved)} optimizer parameter groups, the engine "
                         f"has {len(current)}; build the optimizer with the same parameter groups")
    for gi, (s, g) in enumerate(zip(saved, current)):
        ep_saved = s.get("expert", {}).get("ep_size", 1)
        ep_now = g.get("expert", {}).get("ep_size", 1)
        if ep_saved != ep_now:
            raise ValueError(f"hf_zero: checkpoint {str(path)!r} group {gi} holds MoE experts saved with "
                             f"ep_size={ep_saved}, the engine runs ep_size={ep_now}; an engine checkpoint loads at "
                             f"the ep_size it was saved with (its model file holds every expert under its global "
                             f"index: read it with safetensors to move the weights to another ep_size)")
        if list(s["numels"]) != list(g["numels"]):
            diff = [f"{n} (saved {a}, now {b})" for n, a, b in zip(g["names"], s["numels"], g["numels"]) if a != b]
            raise ValueError(f"hf_zero: checkpoint {str(path)!r} group {gi} does not match the model: "
                             f"{len(s['numels'])} saved parameters vs {len(g['numels'])}; differing: {diff[:5]}; "
                             f"saved names start {s['names'][:3]}, model's start {g['names'][:3]}")


def save_16bit_model(engine, save_dir, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """Rank 0 writes the whole model's weights in the training dtype, atomically, in the format the file name says:
    safetensors for ``*.safetensors``, else torch.save's pickled state dict -- what DeepSpeed writes under any name
    (its default ``pytorch_model.bin``), and what a script naming a ``.bin``/``.pt`` file loads with torch.load."""
    sd = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    tp = tp_info(engine.module)  # every TP rank of the first replica holds the gathered weights: one writes
    if engine.global_rank == 0 and (tp is None or tp.mesh.get_local_rank() == 0):
        root = Path(save_dir)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{save_filename}.tmp"
        if save_filename.endswith(".safetensors"):
            sd, aliases = dedupe_shared(sd)  # safetensors refuses shared storage: tied names are kept as aliases
            save_file(sd, str(tmp), metadata={"format": "pt", "aliases": json.dumps(aliases)})
        else:
            torch.save(sd, str(tmp))  # tied weights stay one tensor under both names
        os.replace(tmp, root / save_filename)
    comm.barrier(engine.process_group)
    return True
