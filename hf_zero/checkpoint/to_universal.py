"""DeepSpeed's ``ds_to_universal``: a checkpoint tag rewritten as a *universal* checkpoint -- every parameter whole
in its own files -- which ``checkpoint.load_universal`` loads on any number of ranks.

    python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step10 \\
        --output_folder ckpt/global_step10_universal      # then "checkpoint": {"load_universal": true}

hf_zero's own checkpoints already load on any world size and ZeRO stage, so a script does not need this step on
hf_zero; it runs because scripts written for DeepSpeed run it. The input is an hf_zero tag or a tag DeepSpeed wrote
(read by deepspeed_format.py: no DeepSpeed installation needed); the output is DeepSpeed's universal layout::

    <output>/zero/<name>/fp32.pt         {"param": the fp32 weight, "cat_dim": 0}; also each frozen parameter
    <output>/zero/<name>/<state>.pt      each optimizer state (exp_avg, exp_avg_sq), the same way
    <output>/zero/<name>/step.pt         the optimizer's step (an int)
    <output>/zero/optimizer_state.pt     ZeRO stage, param_groups, loss scale
    <output>/mp_rank_00_model_states.pt  the module's state dict, param_shapes, counters, LR scheduler, client_state
    <output>/../latest_universal         the output folder's name

Every file is a dict of tensors and plain values (``torch.load(weights_only=True)`` reads it). The output is written
into a temporary sibling directory and renamed into place once complete. Expert-parallel MoE checkpoints are
refused by name.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from hf_zero.checkpoint.deepspeed_format import DeepSpeedTag, is_deepspeed_tag, read_deepspeed_tag
from hf_zero.checkpoint.disk_format import open_saved
from hf_zero.checkpoint.files import CheckpointError, torch_load
from hf_zero.checkpoint.reshard import full_param_from_shards
from hf_zero.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from hf_zero.zero.layout import ShardLayout
from hf_zero.zero.saved_pieces import group_prefix

__all__ = ["write_universal", "parse_arguments", "main"]

# the DeepSpeed release whose universal layout this writes, as ``ds_version`` (DeepSpeed parses it as a version)
UNIVERSAL_FORMAT_OF = "0.19.8+hfzero"


def _read_hf_zero_tag(path: Path) -> DeepSpeedTag:
    """An hf_zero tag as the same name-keyed record a DeepSpeed tag is read into."""
    meta, handles = open_saved(path)
    if any("expert" in g for g in meta["groups"]):
        raise CheckpointError(f"hf_zero: ds_to_universal: {str(path)!r} holds expert-parallel MoE groups; a "
                              f"universal checkpoint of them is not written (load the tag itself: hf_zero "
                              f"checkpoints load on any world size)")
    sd = get_fp32_state_dict_from_zero_checkpoint(path.parent, tag=path.name)
    module = meta["module"]
    shapes = {n: torch.Size(e["shape"]) for e in module["params"] for n in e["names"]}
    groups, fp32, states = [], [], []
    for gi, g in enumerate(meta["groups"]):
        layout = ShardLayout(tuple(g["numels"]), int(meta["shard_world_size"]))
        prefix = group_prefix(gi, None)
        keys = sorted(k[len(prefix + "state."):] for k in handles[0].keys() if k.startswith(prefix + "state."))
        groups.append([(n, shapes[n]) for n in g["names"]])
        fp32.append([sd[n] for n in g["names"]])
        states.append([{k: full_param_from_shards(handles, f"{prefix}state.{k}", layout, i).float().view(shapes[n])
                        for k in keys} for i, n in enumerate(g["names"])])
    engine_state = torch_load(path / "engine_state.pt")
    frozen = {n: sd[n] for e in module["params"] if not e["trainable"] for n in e["names"][:1] if n in sd}
    tied = {alias: e["names"][0] for e in module["params"] for alias in e["names"][1:]}
    scaler = engine_state.get("loss_scaler")
    return DeepSpeedTag(
        path=path, stage=int(meta.get("stage", 0)), world_size=int(meta.get("world_size", 1)), groups=groups,
        fp32=fp32, states=states,
        steps=[int(s["step"]) if "step" in s else None for s in meta["optimizer_scalar_state"]],
        param_groups=list(meta["param_groups"]),
        module={n: v for n, v in sd.items() if n not in tied}, buffer_names=list(module["buffers"]),
        frozen=frozen, shared=tied,
        loss_scaler=({"cur_scale": scaler["scale"], "cur_iter": scaler["good_steps"], "last_overflow_iter": -1,
                      "cur_hysteresis": scaler["hysteresis_left"]} if scaler else None),
        lr_scheduler=engine_state.get("lr_scheduler"), global_steps=int(engine_state["global_steps"]),
        global_samples=int(engine_state["global_samples"]), skipped_steps=int(engine_state["skipped_steps"]),
        client_state=dict(engine_state.get("client_state") or {}), ds_version=UNIVERSAL_FORMAT_OF)


def write_universal(input_folder, output_folder) -> Path:
    """Write tag ``input_folder`` (hf_zero's or DeepSpeed's) as a universal checkpoint at ``output_folder`` and
    name it in ``latest_universal`` beside it; returns the output path."""
    src, out = Path(input_folder), Path(output_folder)
    if not src.is_dir():
        raise CheckpointError(f"hf_zero: ds_to_universal: input folder {str(src)!r} does not exist")
    if is_deepspeed_tag(src):
        tag = read_deepspeed_tag(src)
        if tag.stage == 0:
            raise CheckpointError(f"hf_zero: ds_to_universal: {str(src)!r} is a DeepSpeed checkpoint without ZeRO "
                                  f"(no parameter names in its optimizer state); load it into an engine instead")
    elif (src / "meta.json").is_file():
        tag = _read_hf_zero_tag(src)
    else:
        raise CheckpointError(f"hf_zero: ds_to_universal: {str(src)!r} is neither an hf_zero checkpoint tag "
                              f"(meta.json) nor a DeepSpeed one (mp_rank_00_model_states.pt)")
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(tag, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest = out.parent / "latest_universal"
    latest.with_suffix(".tmp").write_text(out.name)
    os.replace(latest.with_suffix(".tmp"), latest)
    return out


def _write(tag: DeepSpeedTag, out: Path) -> None:
    zero = out / "zero"
    zero.mkdir(parents=True)

    def put(name: str, what: str, value) -> None:
        (zero / name).mkdir(exist_ok=True)
        torch.save(value if not torch.is_tensor(value) else {"param": value.contiguous(), "cat_dim": 0},
                   zero / name / f"{what}.pt")

    for group, ws, sts, step in zip(tag.groups, tag.fp32, tag.states, tag.steps):
        for (name, _), w, st in zip(group, ws, sts):
            put(name, "fp32", w.float())
            for key, value in st.items():
                put(name, key, value.float())
            if step is not None:
                put(name, "step", int(step))
    for name, value in tag.frozen.items():
        put(name, "fp32", value)
    torch.save({"zero_stage": int(tag.stage), "ds_version": tag.ds_version, "loss_scaler": tag.loss_scaler,
                "dynamic_loss_scale": bool(tag.loss_scaler and tag.loss_scaler.get("dynamic", True)),
                "param_groups": [{**{k: v for k, v in pg.items() if k != "params"}, "params": [i]}
                                 for i, pg in enumerate(tag.param_groups)]},
               zero / "optimizer_state.pt")
    module = OrderedDict(tag.module)
    for group, ws in zip(tag.groups, tag.fp32):  # a DeepSpeed tag's module holds 16-bit (or ZeRO-3 empty) weights
        module.update({name: w for (name, _), w in zip(group, ws)})
    module.update(tag.frozen)
    torch.save({
        **tag.client_state,
        "module": module, "buffer_names": list(tag.buffer_names),
        "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in group) for group in tag.groups],
        "frozen_param_shapes": OrderedDict((n, v.shape) for n, v in tag.frozen.items()),
        "frozen_param_fragments": None, "shared_params": dict(tag.shared),
        "lr_scheduler": tag.lr_scheduler, "global_steps": tag.global_steps, "global_samples": tag.global_samples,
        "skipped_steps": tag.skipped_steps, "dp_world_size": tag.world_size, "mp_world_size": 1,
        "ds_version": tag.ds_version,
    }, out / "mp_rank_00_model_states.pt")


# DeepSpeed's flags that tune its extraction (worker pools, a temporary folder of per-parameter files, relaxed
# checks, state injected for Megatron checkpoints), which this converter does not have: accepted, and a note on
# stderr names each one given, with what happens instead.
_NO_EFFECT = {
    "num_extract_workers": "this process reads the tag itself, without worker processes",
    "num_merge_workers": "this process reads the tag itself, without worker processes",
    "keep_temp_folder": "no temporary folder is written",
    "strict": "the checks stay strict (a parameter missing from the tag is an error)",
    "inject_missing_state": "the universal checkpoint's own state is always written",
}


def parse_arguments(argv=None) -> argparse.Namespace:
    """DeepSpeed's command line (the flags in ``_NO_EFFECT`` are accepted and change nothing, said on stderr)."""
    p = argparse.ArgumentParser(description="Convert a checkpoint tag into a universal checkpoint (hf_zero)")
    p.add_argument("--input_folder", required=True, help="the checkpoint tag folder (hf_zero's or DeepSpeed's)")
    p.add_argument("--output_folder", required=True, help="where the universal checkpoint is written")
    p.add_argument("--num_extract_workers", type=int, default=4)
    p.add_argument("--num_merge_workers", type=int, default=2)
    p.add_argument("--keep_temp_folder", action="store_true")
    p.add_argument("--no_strict", dest="strict", action="store_false")
    p.add_argument("--inject_missing_state", action="store_true")
    return p.parse_args(argv)


def main(args: argparse.Namespace | None = None) -> int:
    args = args if args is not None else parse_arguments()
    defaults = parse_arguments(["--input_folder", "-", "--output_folder", "-"])
    for key, instead in _NO_EFFECT.items():
        if getattr(args, key) != getattr(defaults, key):
            flag = "--no_strict" if key == "strict" else f"--{key}"
            print(f"hf_zero: {flag} has no effect in hf_zero's converter: {instead}", file=sys.stderr)
    out = write_universal(args.input_folder, args.output_folder)
    print(f"hf_zero: universal checkpoint of {args.input_folder} written to {out} "
          f"({out.parent / 'latest_universal'} names it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
