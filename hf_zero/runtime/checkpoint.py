"""Engine checkpoints: written atomically, tensors in safetensors, loadable on any world size.

Layout of ``save_dir``::

    latest                          the newest complete tag (replaced atomically)
    <tag>/meta.json                 world size, stage, per group: parameter names and numels; scalar optimizer state
    <tag>/model.safetensors         rank 0: the model's state dict (stages 0-2; whole parameters on every rank)
    <tag>/zero_rank00003.safetensors  rank 3: fp32 master shard and optimizer-state shards of every group, RNG state
    <tag>/engine_state.pt           rank 0: counters, loss scaler, LR scheduler, client_state (loaded weights_only)

Atomicity: every rank writes into ``.tmp-<tag>``; the ranks agree (one all-reduce) that all writes succeeded; only
then rank 0 renames the directory into place and rewrites ``latest``. A crash or error part-way leaves the previous
checkpoint and ``latest`` untouched; a leftover ``.tmp-*`` directory is ignored and replaced by the next save.

Resharding: shards follow :class:`~hf_zero.zero.layout.ShardLayout` (per-parameter chunks), so a checkpoint written
on N ranks is re-cut for M ranks at load time from the per-parameter chunks -- no offline converter.
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
from safetensors.torch import load_file, save_file

from hf_zero import comm
from hf_zero.offload.swapper import wait_all
from hf_zero.tensor_parallel import tp_info
from hf_zero.zero.layout import ShardLayout

__all__ = ["save_checkpoint", "load_checkpoint", "save_16bit_model", "read_latest_tag"]

logger = logging.getLogger("hf_zero")

FORMAT_VERSION = 1


def _rank_file(rank: int) -> str:
    return f"zero_rank{rank:05d}.safetensors"


def read_latest_tag(load_dir: str | os.PathLike) -> str | None:
    path = Path(load_dir) / "latest"
    return path.read_text().strip() if path.is_file() else None


def _dedupe_shared(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors sharing storage (tied embeddings): keep one, remember the aliases."""
    first: dict[tuple, str] = {}
    out, aliases = {}, {}
    for name, t in sd.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in first:
            aliases[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        out[name] = t.detach().contiguous()
    return out, aliases


def _write_rank_files(engine, tmp: Path, exclude_frozen: bool) -> None:
    rank = engine.global_rank
    tensors: dict[str, torch.Tensor] = {"rng.cpu": torch.get_rng_state()}
    for gi, g in enumerate(engine.groups):
        if engine.stage == 0 and rank != 0:
            break  # stage 0: every rank holds the same full state; rank 0 writes it
        if engine.optimizer.offload is not None:
            # offloaded states (CPU memory / NVMe files): read back whole, saved under the same keys as resident ones
            full = engine.optimizer.offload.state_tensors(gi)
            tensors[f"group{gi}.master"] = full["master"]
            if engine.optimizer.state.get(g.master):  # moments exist once the optimizer has stepped
                tensors.update({f"group{gi}.state.{k}": full[k] for k in ("exp_avg", "exp_avg_sq")})
            continue
        tensors[f"group{gi}.master"] = g.master
        for key, value in engine.optimizer.state.get(g.master, {}).items():
            # per-element state (exp_avg, ...) is 1-d like the master, also for a group with no trainable
            # parameter (a LoRA run's no-decay group: 0 elements); 0-d tensors (step) are scalars
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() == g.master.numel():
                tensors[f"group{gi}.state.{key}"] = value
    if engine.stage3 is not None:
        tensors.update(engine.stage3.checkpoint_tensors(exclude_frozen=exclude_frozen))
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp / _rank_file(rank)))
    if rank != 0:
        return
    if engine.stage3 is None:
        sd, aliases = _dedupe_shared(engine.module_state_dict(exclude_frozen))
        save_file(sd, str(tmp / "model.safetensors"), metadata={"aliases": json.dumps(aliases)})
    scalar_state = []
    for g in engine.groups:
        st = engine.optimizer.state.get(g.master, {})
        scalar_state.append({k: (v.item() if torch.is_tensor(v) else v) for k, v in st.items()
                             if not (torch.is_tensor(v) and v.dim() > 0 and v.numel() == g.master.numel())})
    meta = {
        "format_version": FORMAT_VERSION, "world_size": engine.world_size, "stage": engine.stage,
        "shard_world_size": engine.groups[0].world_size if engine.groups else 1,
        "groups": [{"names": g.names, "numels": list(g.layout.numels)} for g in engine.groups],
        "optimizer_scalar_state": scalar_state,
        "param_groups": [{k: v for k, v in pg.items() if k != "params" and isinstance(v, (int, float, bool, str,
                                                                                          list, tuple, type(None)))}
                         for pg in engine.optimizer.param_groups],
        "global_steps": engine.global_steps,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    torch.save({
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps, "skipped_steps": engine.optimizer.skipped_steps,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "client_state": engine._pending_client_state,
        "config": dict(engine.config),
    }, tmp / "engine_state.pt")


def save_checkpoint(engine, save_dir, *, tag=None, client_state: dict, save_latest: bool,
                    exclude_frozen_parameters: bool) -> bool:
    """Write a checkpoint on every rank (collective). Raises, leaving the previous checkpoint intact, on failure."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if "/" in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain directory name")
    root = Path(save_dir)
    tmp, final = root / f".tmp-{tag}", root / tag
    group = engine.process_group
    if engine.global_rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    comm.barrier(group)
    error: BaseException | None = None
    engine._pending_client_state = client_state
    try:
        _write_rank_files(engine, tmp, exclude_frozen_parameters)
    except Exception as exc:  # every rank must reach the agreement below, or the others would hang
        error = exc
    finally:
        engine._pending_client_state = None
    ok = torch.tensor([0.0 if error is not None else 1.0])
    failed = torch.tensor([float(engine.global_rank) if error is not None else -1.0])
    if comm.is_initialized() and engine.world_size > 1:
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=group)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, group=group)
    if ok.item() < 1:
        if engine.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier(group)
        raise RuntimeError(f"hf_zero: save_checkpoint({str(root)!r}, tag={tag!r}) failed on rank "
                           f"{int(failed.item())}; the previous checkpoint is untouched") from error
    if engine.global_rank == 0:
        old = root / f".old-{tag}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            latest_tmp = root / ".latest.tmp"
            latest_tmp.write_text(tag)
            os.replace(latest_tmp, root / "latest")
    comm.barrier(group)
    return True


def _full_param_from_shards(files: list, key: str, layout: ShardLayout, index: int) -> torch.Tensor:
    """Reassemble parameter ``index``'s flat tensor from the chunks in every saved rank's file."""
    lo, hi = layout.offsets[index], layout.offsets[index + 1]
    parts = [f.get_slice(key)[lo:hi] for f in files]
    return torch.cat(parts)[:layout.numels[index]]


def load_checkpoint(engine, load_dir, *, tag=None, load_module_strict: bool, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool):
    """Restore a checkpoint (any saved world size). Returns ``(path, client_state)``, or ``(None, None)``."""
    root = Path(load_dir)
    tag = tag if tag is not None else read_latest_tag(root)
    if tag is None:
        logger.warning("hf_zero: load_checkpoint(%r): no 'latest' file and no tag given; nothing loaded", str(root))
        return None, None
    path = root / str(tag)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"hf_zero: checkpoint {str(path)!r} is missing or incomplete (no meta.json); "
                                f"tags present: {sorted(p.name for p in root.iterdir() if p.is_dir())}")
    meta = json.loads((path / "meta.json").read_text())
    _check_groups(engine, meta, path)

    if engine.stage3 is None and (path / "model.safetensors").is_file():
        sd = load_file(str(path / "model.safetensors"), device="cpu")
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        for alias, src in aliases.items():
            sd[alias] = sd[src]
        missing, unexpected = engine.module.load_state_dict(sd, strict=load_module_strict)
        if missing or unexpected:
            logger.info("hf_zero: non-strict module load: %d missing, %d unexpected keys", len(missing),
                        len(unexpected))

    saved_shard_world = meta["shard_world_size"]
    rank_files = [path / _rank_file(r) for r in range(saved_shard_world)]
    handles = [safe_open(str(p), "pt") for p in rank_files]
    try:
        if engine.stage3 is not None:
            engine.stage3.load_checkpoint_tensors(handles, meta)
        for gi, g in enumerate(engine.groups):
            # with optimizer offload: full copies of the group's states, filled below and then written back
            offloaded = engine.optimizer.offload.state_tensors(gi) if engine.optimizer.offload is not None else None
            saved_layout = ShardLayout(tuple(meta["groups"][gi]["numels"]), saved_shard_world)
            keys = [k for k in handles[0].keys() if k.startswith(f"group{gi}.")]
            for key in keys:
                name = key.split(".", 1)[1]
                if name != "master" and not load_optimizer_states:
                    continue
                target = g.master if name == "master" else None
                if offloaded is not None:
                    target = offloaded[name if name == "master" else name.split(".", 1)[1]]
                if target is None:
                    state = engine.optimizer.state.setdefault(g.master, {})
                    target = state.setdefault(name.split(".", 1)[1], torch.zeros_like(g.master))
                if saved_layout == g.layout:
                    target.copy_(handles[g.rank].get_tensor(key))
                else:
                    for i in range(len(g.params)):
                        full = _full_param_from_shards(handles, key, saved_layout, i)
                        g.layout.shard_of(full, i, g.rank, target[g.layout.offsets[i]:g.layout.offsets[i + 1]])
            if offloaded is not None:
                engine.optimizer.offload.load_state_tensors(gi, offloaded)  # also refreshes param16
            else:
                wait_all(g.write_param16(0, g.shard_numel, g.master))
            if load_optimizer_states:
                for k, v in meta["optimizer_scalar_state"][gi].items():
                    engine.optimizer.state.setdefault(g.master, {})[k] = torch.tensor(float(v))
        if load_optimizer_states:
            for pg, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
                pg.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    finally:
        del handles
    engine.optimizer.publish()
    own_file = path / _rank_file(engine.global_rank)
    if meta["world_size"] == engine.world_size and own_file.is_file():  # RNG streams only resume on the same ranks
        with safe_open(str(own_file), "pt") as f:
            if "rng.cpu" in f.keys():
                torch.set_rng_state(f.get_tensor("rng.cpu"))

    state = torch.load(path / "engine_state.pt", map_location="cpu", weights_only=True)
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.micro_steps = state["micro_steps"]
    if load_optimizer_states:
        engine.optimizer.skipped_steps = state["skipped_steps"]
        if engine.loss_scaler is not None and state["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(state["loss_scaler"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    comm.barrier(engine.process_group)
    return str(path), state["client_state"]


def _check_groups(engine, meta: dict, path: Path) -> None:
    saved = meta["groups"]
    if len(saved) != len(engine.groups):
        raise ValueError(f"hf_zero: checkpoint {str(path)!r} has {len(saved)} optimizer parameter groups, the engine "
                         f"has {len(engine.groups)}; build the optimizer with the same parameter groups")
    for gi, (s, g) in enumerate(zip(saved, engine.groups)):
        if list(s["numels"]) != list(g.layout.numels):
            diff = [f"{n} (saved {a}, now {b})" for n, a, b in zip(g.names, s["numels"], g.layout.numels) if a != b]
            raise ValueError(f"hf_zero: checkpoint {str(path)!r} group {gi} does not match the model: "
                             f"{len(s['numels'])} saved parameters vs {len(g.params)}; differing: {diff[:5]}; "
                             f"saved names start {s['names'][:3]}, model's start {g.names[:3]}")


def save_16bit_model(engine, save_dir, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """Rank 0 writes the whole model's weights in the training dtype, atomically, as safetensors."""
    sd = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    tp = tp_info(engine.module)  # every TP rank of the first replica holds the gathered weights: one writes
    if engine.global_rank == 0 and (tp is None or tp.mesh.get_local_rank() == 0):
        root = Path(save_dir)
        root.mkdir(parents=True, exist_ok=True)
        sd, aliases = _dedupe_shared(sd)
        tmp = root / f".{save_filename}.tmp"
        save_file(sd, str(tmp), metadata={"format": "pt", "aliases": json.dumps(aliases)})
        os.replace(tmp, root / save_filename)
    comm.barrier(engine.process_group)
    return True
