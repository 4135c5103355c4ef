"""DeepSpeed's ``zero_to_fp32`` over hf_zero's checkpoints: one fp32 state dict from any engine checkpoint (ZeRO
stage 0-3, any number of ranks), offline -- one process, no process group, no model.

The contract is DeepSpeed's (``deepspeed/utils/zero_to_fp32.py``): trainable parameters come from the fp32 master
weights (a bf16 master is widened), buffers as fp32 where they are floating point, frozen parameters as saved,
every name of a tied weight pointing at one tensor; ``tag=None`` reads ``latest``. What differs:

* it reads hf_zero's layout (``<tag>/meta.json``, ``zero_rank*.safetensors``) and DeepSpeed's
  (``mp_rank_00_model_states.pt``, ``*_optim_states.pt``: deepspeed_format.py) -- a run trained on DeepSpeed
  converts with hf_zero answering ``import deepspeed``; a DeepSpeed tag without ZeRO gives its saved fp32 module
  (DeepSpeed's converter refuses one);
* integer buffers keep their dtype (DeepSpeed casts every buffer to float);
* ``lazy_mode`` is accepted and returns ordinary tensors (they answer ``.contiguous()`` as its lazy ones do);
* ``convert_zero_checkpoint_to_fp32_state_dict`` with ``safe_serialization`` writes each tied weight once, its
  other names in the file's ``aliases`` metadata (safetensors refuses shared tensors; transformers re-ties them on
  load); an ``output_dir`` ending in ``.bin``/``.pt``/``.pth``/``.safetensors`` is written as that one file (the
  ``output_file`` of DeepSpeed before 0.15).

MoE layers with ``ep_size > 1`` (expert parallelism, stages 0-2): every rank holds ``num_experts / ep_size``
experts, their fp32 masters saved per EP rank (``group<i>.ep<e>.*``, cut over the ranks meta.json names); the result
holds every expert under its global index -- the ``ep_size=1`` model's names, as ``model.safetensors`` and the
consolidated 16-bit state dict do. DeepSpeed 0.19.8's converter has no native-MoE path: on its own checkpoint of
``MoE(ep_size=2)`` on 2 ranks (stages 1 and 2) it raises ``ValueError: .../layer_0_expert_0_mp_rank_00_model_states.pt
is not a model state checkpoint`` (its ``*_model_states.pt`` glob picks up the per-expert files).

The shards are reassembled by the checkpoint loader's own re-cut (``reshard.full_param_from_shards``) from the files as
saved, each verified against the checkpoint's manifest first. Pipeline and tensor-parallel checkpoints are
refused naming what does read them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf_zero.checkpoint.deepspeed_format import is_deepspeed_tag, read_deepspeed_tag
from hf_zero.checkpoint.disk_format import (dedupe_shared, expert_layers, open_saved, open_shard_file, rank_file,
                                            read_latest_tag, read_model_file)
from hf_zero.checkpoint.files import CheckpointError, read_manifest, resolve_checkpoint, verify_files
from hf_zero.checkpoint.reshard import full_param_from_shards
from hf_zero.zero.layout import ShardLayout
from hf_zero.zero.saved_pieces import SavedPieces
from hf_zero.zero.stage3.param import sharded_param_of

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict", "main"]

logger = logging.getLogger("hf_zero")

_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The full model's state dict (CPU) from ``<checkpoint_dir>/<tag>``; ``tag=None``: the one ``latest`` names.
    ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False``. A checkpoint of MoE layers
    with ``ep_size > 1`` gives every expert under its global index (the ``ep_size=1`` model's names)."""
    path = _tag_dir(Path(checkpoint_dir), tag)
    if is_deepspeed_tag(path):
        return _from_deepspeed(path, exclude_frozen_parameters)
    meta, handles = open_saved(path)
    stage = int(meta.get("stage", 0))
    model_sd = _model_file(path) if stage < 3 else None
    module = meta.get("module") or _legacy_description(path, meta, model_sd, exclude_frozen_parameters)
    experts = _ExpertNames(expert_layers(meta, path / "meta.json"))
    pieces = _PieceFiles(path, handles, meta)
    where = {name: (gi, i) for gi, g in enumerate(meta["groups"]) for i, name in enumerate(g["names"])}
    rank0_keys = set(handles[0].keys()) if handles else set()
    out: dict[str, torch.Tensor] = {}
    for entry in module["params"]:
        names, shape = entry["names"], torch.Size(entry["shape"])
        hit = next((n for n in names if n in where), None)
        # an expert-parallel layer's expert: one tensor per EP rank (meta.json names the experts of EP rank 0)
        for ep_rank, out_names in experts.copies(names):
            if hit is not None:
                gi, i = where[hit]
                files, key, layout = pieces.master(gi, ep_rank)
                if shape.numel() != layout.numels[i]:
                    raise CheckpointError(f"hf_zero: checkpoint file {str(path / 'meta.json')!r}: {hit} has shape "
                                          f"{tuple(shape)} but {layout.numels[i]} elements in optimizer group {gi}")
                value = _fp32(full_param_from_shards(files, key, layout, i).view(shape))
            elif entry["trainable"] and stage == 3:
                raise CheckpointError(f"hf_zero: checkpoint {str(path)!r}: {names[0]} requires grad but is in no "
                                      f"optimizer group, so a ZeRO-3 checkpoint holds no values for it")
            elif entry["trainable"] or not exclude_frozen_parameters:
                value = _saved_whole(path, out_names, shape, model_sd, handles, rank0_keys)
                if value is None:
                    continue  # saved with exclude_frozen_parameters=True: not in the checkpoint, as in DeepSpeed's
            else:
                continue
            for name in out_names:
                out[name] = value
    for local_name in module["buffers"]:
        for _, (name,) in experts.copies([local_name]):
            if model_sd is not None and name in model_sd:
                value = model_sd[name]
            elif f"stage3.buffer.{name}" in rank0_keys:
                value = handles[0].get_tensor(f"stage3.buffer.{name}")
            else:
                raise CheckpointError(f"hf_zero: checkpoint {str(path)!r} has no saved value for the buffer {name!r}")
            out[name] = value.float() if value.is_floating_point() else value
    logger.info("hf_zero: zero_to_fp32: %s (ZeRO stage %d, %d shard file(s)): %d tensors, %d elements", path,
                stage, len(pieces.opened), len(out), sum(t.numel() for t in {id(t): t for t in out.values()}.values()))
    return out


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the consolidated fp32 state dict into it (``strict=False``, as
    DeepSpeed's); returns the model. The model must be an ordinary module, not one a live ZeRO-3 engine holds."""
    partitioned = [n for n, p in model.named_parameters() if sharded_param_of(p) is not None]
    if partitioned:
        raise ValueError(f"hf_zero: load_state_dict_from_zero_checkpoint: {partitioned[0]} (and "
                         f"{len(partitioned) - 1} more) are partitioned by a ZeRO-3 engine; pass a freshly built "
                         f"model, or resume the engine with engine.load_checkpoint({str(checkpoint_dir)!r})")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    result = model.load_state_dict(state_dict, strict=False)
    if result.missing_keys or result.unexpected_keys:
        logger.info("hf_zero: load_state_dict_from_zero_checkpoint: missing %s, unexpected %s",
                    result.missing_keys[:5], result.unexpected_keys[:5])
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag=None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the consolidated fp32 state dict into ``output_dir``: ``pytorch_model.bin`` (``torch.save``) or
    ``model.safetensors``, split into shards of at most ``max_shard_size`` with transformers' index file when it is
    larger (``None``: one file)."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = Path(output_dir)
    if out.suffix in _FILE_SUFFIXES:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(state_dict, out, out.suffix == ".safetensors")
        return
    out.mkdir(parents=True, exist_ok=True)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    if max_shard_size is None:
        _write(state_dict, out / weights_name, safe_serialization)
        return
    from huggingface_hub import split_torch_state_dict_into_shards  # transformers' own dependency

    pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(state_dict, filename_pattern=pattern, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        _write({n: state_dict[n] for n in names}, out / filename, safe_serialization)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        index_name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        _replace_with(out / index_name, lambda tmp: tmp.write_text(json.dumps(index, indent=2, sort_keys=True)))


def main(argv: list[str] | None = None) -> int:
    """DeepSpeed's ``zero_to_fp32.py`` command line (the script save_checkpoint writes beside the tags)."""
    parser = argparse.ArgumentParser(prog="zero_to_fp32.py", description="Consolidate an hf_zero checkpoint into "
                                     "one fp32 state dict, offline")
    parser.add_argument("checkpoint_dir", help="the directory holding 'latest' and the tag folders, e.g. ckpt/")
    parser.add_argument("output_dir", help="where pytorch_model.bin / model.safetensors (and shards) go")
    parser.add_argument("--max_shard_size", default="5GB", help="largest file before the output is sharded")
    parser.add_argument("--safe_serialization", action="store_true", help="safetensors instead of torch.save")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step14 (default: latest)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="log each step")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s")
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                               max_shard_size=args.max_shard_size,
                                               safe_serialization=args.safe_serialization, tag=args.tag,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters)
    return 0


# ---- reading ---------------------------------------------------------------------------------------------------
def _from_deepspeed(path: Path, exclude_frozen_parameters: bool) -> dict[str, torch.Tensor]:
    """A tag DeepSpeed wrote (deepspeed_format.py), with DeepSpeed's converter's result: trainable parameters from
    the fp32 masters, frozen ones as saved, buffers (floating ones as fp32), tied names sharing one tensor. Stage 0
    (no ZeRO files; DeepSpeed's converter refuses it) gives the saved module's weights when they are fp32."""
    ds = read_deepspeed_tag(path)
    if ds.stage == 0:
        low = sorted({str(v.dtype) for k, v in ds.module.items() if k not in ds.buffer_names
                      and v.is_floating_point() and v.dtype != torch.float32})
        if low:
            raise CheckpointError(f"hf_zero: zero_to_fp32: {str(path)!r} is a DeepSpeed checkpoint without ZeRO "
                                  f"whose weights are saved in {low[0]} and whose fp32 masters are one flat vector "
                                  f"without parameter names; load it into an engine (engine.load_checkpoint) and "
                                  f"save it from there")
        return {k: v for k, v in ds.module.items()}
    out: dict[str, torch.Tensor] = dict(ds.named_fp32())
    if not exclude_frozen_parameters:
        for name, value in ds.module.items():
            if name not in out and name not in ds.buffer_names and name not in ds.shared:
                whole = ds.frozen.get(name, value)
                if whole.numel() > 0:
                    out[name] = whole
    for name in ds.buffer_names:
        value = ds.module[name]
        out[name] = value.float() if value.is_floating_point() else value
    for tied, source in ds.shared.items():
        if source in out:
            out[tied] = out[source]
    logger.info("hf_zero: zero_to_fp32: DeepSpeed %s checkpoint %s (ZeRO stage %d, %d ranks): %d tensors",
                ds.ds_version, path, ds.stage, ds.world_size, len(out))
    return out


def _tag_dir(root: Path, tag) -> Path:
    """``<root>/<tag>`` (``latest`` when ``tag`` is None), refusing with the reason what this converter cannot read."""
    present = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if root.is_dir() else []
    if tag is None:
        tag = read_latest_tag(root)
        if tag is None:  # a ValueError, as DeepSpeed's
            raise CheckpointError(f"hf_zero: zero_to_fp32: no 'latest' file at {str(root / 'latest')!r}; pass the "
                                  f"tag (folders there: {present})")
    path = resolve_checkpoint(root, str(tag))
    if not path.is_dir():  # a FileNotFoundError, as DeepSpeed's
        raise FileNotFoundError(f"hf_zero: zero_to_fp32: checkpoint directory {str(path)!r} does not exist "
                                f"(folders in {str(root)!r}: {present})")
    for marker, what in (("pipeline.json", "a pipeline checkpoint: its full weights are the layer_*-model_states.pt "
                                           "files beside it"),
                         ("tp.json", "a tensor-parallel checkpoint: tp/rank00/state/model.safetensors holds the "
                                     "gathered model")):
        if (path / marker).is_file():
            raise CheckpointError(f"hf_zero: zero_to_fp32: {str(path)!r} is {what}; or load it into an engine "
                                  f"and call engine.save_16bit_model()")
    return path


class _ExpertNames:
    """Names of expert-parallel layers' experts: meta.json describes EP rank 0's module, whose local expert ``i``
    is global expert ``i``; EP rank ``e``'s local expert ``i`` is global expert ``e * num_local_experts + i``
    (hf_zero/moe/state.py names them so in model.safetensors, as the consolidated 16-bit state dict does)."""

    def __init__(self, layers: list[tuple[str, int, int]]):
        self.layers = layers  # (prefix, ep_size, num_local_experts)

    def copies(self, names: list[str]) -> list[tuple[int, list[str]]]:
        """``[(ep_rank, names of that EP rank's copy)]``: one per EP rank for an expert's names, else
        ``[(0, names)]``."""
        for prefix, ep_size, local in self.layers:
            if names[0].startswith(prefix):
                return [(e, [_global_expert_name(n, prefix, e * local) for n in names]) for e in range(ep_size)]
        return [(0, list(names))]


def _global_expert_name(name: str, prefix: str, first: int) -> str:
    index, _, rest = name[len(prefix):].partition(".")
    return f"{prefix}{first + int(index)}.{rest}"


class _PieceFiles:
    """Where each optimizer group's fp32 masters are (hf_zero/zero/saved_pieces.py): an ordinary group's cut over
    the saved data-parallel world (every ``zero_rank*`` file of ``open_saved``); an expert-parallel group's, per EP
    rank, over the ranks meta.json names for it (``group<i>.ep<e>.master``; at stage 0 one piece, in its
    expert-data-parallel group's first rank's file) -- files beyond ``open_saved``'s opened here, verified against
    the manifest first."""

    def __init__(self, path: Path, handles: list, meta: dict):
        self.path, self.meta = path, meta
        self.opened = dict(enumerate(handles))
        self.pieces = SavedPieces.of(meta)
        self.manifest = read_manifest(path)

    def master(self, gi: int, ep_rank: int) -> tuple[list, str, ShardLayout]:
        """``(files in piece order, key, saved layout)`` of group ``gi``'s masters (of EP rank ``ep_rank``)."""
        key = self.pieces.prefix(gi, ep_rank) + "master"
        return ([self._file(r) for r in self.pieces.ranks(key)], key,
                self.pieces.layout(key, self.meta["groups"][gi]["numels"]))

    def _file(self, rank: int):
        if rank not in self.opened:
            name = rank_file(rank)
            if self.manifest is not None:
                verify_files(self.path, self.manifest, [name])
            elif not (self.path / name).is_file():
                raise CheckpointError(f"hf_zero: checkpoint file {str(self.path / name)!r} is missing: it holds "
                                      "expert-parallel MoE experts' fp32 masters")
            self.opened[rank] = open_shard_file(self.path / name)
        return self.opened[rank]


def _model_file(path: Path) -> dict[str, torch.Tensor] | None:
    """A stage 0-2 checkpoint's model.safetensors (buffers, frozen parameters), verified; None if not written."""
    model_file = path / "model.safetensors"
    if not model_file.is_file():
        return None
    manifest = read_manifest(path)
    if manifest is not None:
        verify_files(path, manifest, ["model.safetensors"])
    return read_model_file(model_file)


def _saved_whole(path: Path, names: list[str], shape: torch.Size, model_sd, handles, rank0_keys):
    """A parameter the optimizer does not hold (frozen), whole and as saved; None if the save left it out."""
    for name in names:
        if model_sd is not None and name in model_sd:
            return model_sd[name]
        key = f"stage3.frozen.{name}"
        if key in rank0_keys:  # one shard per rank, cut like the masters
            return full_param_from_shards(handles, key, ShardLayout((shape.numel(),), len(handles)), 0).view(shape)
    if model_sd is None and not rank0_keys:
        raise CheckpointError(f"hf_zero: checkpoint {str(path)!r} has no model.safetensors and no shard files: "
                              f"no saved value for {names[0]}")
    return None


def _legacy_description(path: Path, meta: dict, model_sd, exclude_frozen: bool) -> dict:
    """A checkpoint saved before meta.json described the module: at stages 0-2 its model.safetensors gives the
    names, shapes and ties; frozen parameters and buffers cannot be told apart (both are kept, as saved)."""
    if model_sd is None:
        raise CheckpointError(
            f"hf_zero: checkpoint file {str(path / 'meta.json')!r} has no 'module' entry (saved by an older hf_zero) "
            f"and the checkpoint no model.safetensors (ZeRO stage {meta.get('stage')}): the parameters' shapes are "
            f"unknown. Load it into an engine (engine.load_checkpoint) and save it again, or call "
            f"engine.save_16bit_model()")
    if exclude_frozen:
        raise CheckpointError(f"hf_zero: checkpoint file {str(path / 'meta.json')!r} has no 'module' entry (saved by "
                              f"an older hf_zero): frozen parameters cannot be told from buffers, so "
                              f"exclude_frozen_parameters=True cannot be honoured; load it and save it again")
    trainable = {n for g in meta["groups"] for n in g["names"]}
    entries: dict[int, dict] = {}
    for name, t in model_sd.items():  # read_model_file gives tied names one tensor
        entry = entries.setdefault(id(t), {"names": [], "shape": list(t.shape), "trainable": False})
        entry["names"].append(name)
        entry["trainable"] |= name in trainable
    return {"params": list(entries.values()), "buffers": []}


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """fp32, in storage of its own (a slice of a padded shard concatenation would save the padding with it)."""
    if t.dtype != torch.float32 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.to(torch.float32, copy=True)
    return t


# ---- writing ---------------------------------------------------------------------------------------------------
def _write(state_dict: dict[str, torch.Tensor], path: Path, safetensors: bool) -> None:
    if safetensors:
        unique, aliases = dedupe_shared(state_dict)  # safetensors refuses two names on one tensor
        _replace_with(path, lambda tmp: save_file(unique, str(tmp),
                                                  metadata={"format": "pt", "aliases": json.dumps(aliases)}))
    else:
        _replace_with(path, lambda tmp: torch.save(state_dict, tmp))


def _replace_with(path: Path, write) -> None:
    """``write(tmp)`` then rename over ``path``: a reader never finds half a file under the final name."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
