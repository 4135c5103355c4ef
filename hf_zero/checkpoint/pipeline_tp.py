"""Loading a pipeline checkpoint where tensor parallelism is involved on either side (3D: data x pipeline x
tensor), on any number of stages, replicas and TP size -- TP 1 included, in both directions: a 3D checkpoint into a
pipeline without TP, a plain pipeline checkpoint into a 3D one.

The module comes from the per-layer files (full tensors; each rank keeps its slice of them), the masters and
optimizer states from the stages' per-TP-rank checkpoints: the (stage, TP rank)'s own directory when the cut and
the TP size are the saved ones, else a one-rank checkpoint of exactly this rank's pieces assembled by
reshard.write_recut, re-cut per parameter from the saved TP pieces. The format is described in
hf_zero/checkpoint/pipeline.py.

Validation first: every rank checks what it will read (its layer files present, every tensor of its stage in
them with the model's full shape, every parameter's optimizer state found with a matching layout), the ranks
agree, and only then is anything loaded; errors name the file and the parameter.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from hf_zero.checkpoint.commit import agree_or_raise
from hf_zero.checkpoint.engine import load_checkpoint
from hf_zero.checkpoint.files import CheckpointError, torch_load, verify_files
from hf_zero.checkpoint.pipeline_cut import RESTAGED, ZERO_TAG, layer_file, restage, same_cut, stage_tag, tp_coords
from hf_zero.tensor_parallel.state import load_full_state_dict

__all__ = ["load_tp_pipeline_checkpoint", "read_layer_files"]


def load_tp_pipeline_checkpoint(engine, root: Path, info: dict, manifest: dict | None, *, load_optimizer_states: bool,
                                load_lr_scheduler_states: bool, load_module_strict: bool):
    module = engine.module
    if not hasattr(module, "unit_of"):
        raise CheckpointError(f"hf_zero: {str(root)!r} is a tensor-parallel pipeline checkpoint (TP size "
                              f"{info.get('tp_size', 1)}); it loads into a Hugging Face model cut by "
                              f"hf_zero.pipeline.wrap, not into a {type(module).__name__}")
    if engine.stage3 is not None:
        raise NotImplementedError("hf_zero: loading a pipeline checkpoint with tensor parallelism (written or "
                                  "loaded at TP > 1) into a ZeRO-3 pipeline is not supported: load it at ZeRO "
                                  "stage 0-2 and save again")
    same = same_cut(engine, info)
    # another cut or TP size: this rank's pieces are re-cut into a private temporary directory (nothing is written
    # into the checkpoint being read)
    with tempfile.TemporaryDirectory(prefix="hf_zero_restage_") as tmp:
        error, sd = None, None
        try:
            sd = read_layer_files(module, root, manifest, strict=load_module_strict)
            if not same:
                restage(engine, root, info, Path(tmp) / RESTAGED)
        except Exception as exc:  # every rank must hear of it, or the others would wait for this one
            error = exc
        agree_or_raise(error, "load_checkpoint")
        tp, tp_rank = tp_coords(engine)
        where = (root / "pipe" / stage_tag(engine.stage_id, tp_rank, tp), ZERO_TAG) if same else \
            (Path(tmp), RESTAGED)
        # the module is loaded from the layer files below, after the ordinary loader has validated its files
        _, client_state = load_checkpoint(engine, where[0], tag=where[1], load_module_strict=load_module_strict,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states,
                                          load_module_weights=False)
    # the parameters already hold the masters (the same values, fp32 or rounded as trained); this also brings the
    # buffers and frozen parameters, which have no optimizer state
    load_full_state_dict(module, sd, strict=False)
    return str(root), client_state


def read_layer_files(module, root: Path, manifest: dict | None, *, strict: bool) -> dict[str, torch.Tensor]:
    """This stage's full tensors (name -> tensor) from the per-layer files, each verified against the checkpoint's
    ``manifest`` (None: saved before pipeline manifests) before it is read and checked against the model's full
    shape. A tied LM head is read under the embedding's name (the files keep one copy, as save_pretrained does).
    ``strict``: every tensor of the stage must be there, and the stage's own layer files may hold no others."""
    own = module.state_dict(keep_vars=True)  # DTensors report their full shape
    aliases = module.checkpoint_aliases()
    files: dict[int, tuple[Path, dict]] = {}

    def open_layer(unit: int, wanted: str) -> tuple[Path, dict]:
        if unit not in files:
            path = root / layer_file(unit)
            if not path.is_file():
                raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} is missing: it holds layer {unit} "
                                      f"of the model ({wanted!r} ...); the checkpoint is incomplete")
            if manifest is not None:
                verify_files(root, manifest, [path.name])
            files[unit] = (path, torch_load(path))
        return files[unit]

    out: dict[str, torch.Tensor] = {}
    for key, t in own.items():
        found = None
        for name in (key, *aliases.get(key, ())):
            path, sd = open_layer(module.unit_of(name), name)
            if name in sd:
                found = (path, name, sd[name])
                break
        if found is None:
            if strict:
                path, _ = open_layer(module.unit_of(key), key)
                raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} has no tensor {key!r} (the model's); "
                                      f"load_module_strict=False to leave it as it is")
            continue
        path, name, value = found
        if tuple(value.shape) != tuple(t.shape):
            raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r}: {name!r} has shape "
                                  f"{tuple(value.shape)}, the model's {key!r} has {tuple(t.shape)}")
        out[key] = value
    if strict:
        own_units = {module.unit_of(k) for k in own}
        for unit in sorted(own_units & set(files)):
            path, sd = files[unit]
            extra = [k for k in sd if k not in own]
            if extra:
                raise CheckpointError(f"hf_zero: checkpoint file {str(path)!r} holds {extra[:5]}, which the model "
                                      f"does not have; load_module_strict=False to ignore them")
    return out
