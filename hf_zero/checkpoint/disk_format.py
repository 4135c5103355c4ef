"""The on-disk format of one engine checkpoint tag, as every front-end and the offline converter read it.

    <tag>/meta.json                    world size, stage, per group: parameter names and numels (an expert-parallel
                                       group's: its ep_size and which ranks' files hold its pieces); scalar
                                       optimizer state; the module's shapes, tied names, frozen parameters,
                                       buffers; the expert-parallel MoE layers (``expert_parallel``)
    <tag>/model.safetensors            the module's state dict (stages 0-2), tied names in its ``aliases`` metadata
    <tag>/zero_rank<r:05d>.safetensors rank r's shards: fp32 masters, optimizer states, stage-3 extras, RNG state
    <tag>/engine_state.pt              counters, loss scaler, LR scheduler, client_state (loaded weights_only)
    <tag>/manifest.json                every file's size and sha256 (files.py)

Which engine writes which file is engine.py's; this module only names the files and opens them, verified against
the manifest before anything is parsed. Which rank files hold which optimizer group's pieces, and the names of
expert-parallel groups' tensors, are hf_zero/zero/saved_pieces.py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hf_zero.checkpoint.files import CheckpointError, read_json, read_manifest, verify_files
from hf_zero.zero.saved_pieces import SavedPieces

__all__ = ["FORMAT_VERSION", "rank_file", "read_latest_tag", "dedupe_shared", "open_shard_file", "open_saved",
           "read_model_file", "expert_layers"]

FORMAT_VERSION = 2  # 2: manifest.json with every file's size and sha256


def rank_file(rank: int) -> str:
    """The name of saved rank ``rank``'s shard file."""
    return f"zero_rank{rank:05d}.safetensors"


def read_latest_tag(load_dir: str | os.PathLike, name: str = "latest") -> str | None:
    """The tag file ``name`` in ``load_dir`` names (DeepSpeed's universal checkpoints: ``latest_universal``)."""
    path = Path(load_dir) / name
    return path.read_text().strip() if path.is_file() else None


def dedupe_shared(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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


def open_shard_file(path: Path):
    """A safetensors handle on ``path``; a file that cannot be parsed is a CheckpointError naming it."""
    try:
        return safe_open(str(path), "pt")
    except Exception as exc:
        raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} cannot be read: {exc}") from exc


def open_saved(path: Path) -> tuple[dict, list]:
    """A saved checkpoint directory's meta.json and every saved rank's file (safetensors handles, in rank order),
    verified against its manifest before they are parsed: what the re-cuts of pipeline and tensor-parallel
    checkpoints (reshard.py) and the offline converter read directly."""
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"hf_zero: checkpoint file {str(path / 'meta.json')!r} is missing")
    manifest = read_manifest(path)
    if manifest is not None:
        verify_files(path, manifest, ["meta.json"])
    meta = read_json(path / "meta.json")
    names = [rank_file(r) for r in range(int(meta.get("shard_world_size", 0)))]
    if manifest is not None:
        verify_files(path, manifest, ["engine_state.pt", *names])
    return meta, [open_shard_file(path / name) for name in names]


def read_model_file(model_file: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model.safetensors as the module's state dict: tied names point at one tensor again."""
    try:
        sd = load_file(str(model_file), device="cpu")
        with safe_open(str(model_file), "pt") as f:
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    except Exception as exc:
        raise CheckpointError(f"hf_zero: checkpoint file {str(model_file)!r} cannot be read: {exc}") from exc
    for alias, src in aliases.items():
        sd[alias] = sd[src]
    return sd


def expert_layers(meta: dict, where: Path) -> list[tuple[str, int, int]]:
    """``(state-dict prefix of its experts, ep_size, num_local_experts)`` of every expert-parallel MoE layer a
    checkpoint was saved with (meta.json's ``expert_parallel``): expert ``i`` of EP rank ``e`` is global expert
    ``e * num_local_experts + i``. ``where``: the meta.json, for the error about a checkpoint that lacks them."""
    layers = [(str(d["prefix"]), int(d["ep_size"]), int(d["num_local_experts"]))
              for d in meta.get("expert_parallel", ())]
    if not layers and SavedPieces.of(meta).experts:
        raise CheckpointError(f"hf_zero: checkpoint file {str(where)!r} has expert-parallel optimizer groups but "
                              "no 'expert_parallel' entry (saved by an hf_zero before it recorded its MoE layers): "
                              "load it into an engine with the same ep_size (engine.load_checkpoint) and save it "
                              "again")
    return layers
