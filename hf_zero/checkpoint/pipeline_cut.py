"""A pipeline checkpoint against this engine's cut: the names inside a tag, whether the saved stages (and TP size)
are this engine's, and the re-stage when they are not. Shared by the pipeline front-end (pipeline.py) and its
tensor-parallel load (pipeline_tp.py), so neither imports the other. The layout is described in pipeline.py."""

from __future__ import annotations

from pathlib import Path

from hf_zero.checkpoint.reshard import TPCut, write_recut
from hf_zero.tensor_parallel import tp_info
from hf_zero.tensor_parallel.reshard import param_layout

__all__ = ["ZERO_TAG", "INFO", "RESTAGED", "stage_tag", "layer_file", "tp_coords", "same_cut", "restage"]

ZERO_TAG = "zero"          # each stage checkpoint's tag inside pipe/<stage>/
INFO = "pipeline.json"
RESTAGED = "restaged"  # the tag of the one-rank checkpoint a re-stage writes (outside the checkpoint)


def stage_tag(stage: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    """The directory of one (stage, TP rank)'s ordinary checkpoint under ``pipe/``."""
    return f"stage{stage:02d}" if tp_size == 1 else f"stage{stage:02d}-tp{tp_rank:02d}"


def layer_file(unit: int) -> str:
    """DeepSpeed's per-layer module file name: the full weights of layer ``unit``."""
    return f"layer_{unit:02d}-model_states.pt"


def tp_coords(engine) -> tuple[int, int]:
    """(TP size, this rank's TP rank); (1, 0) without tensor parallelism."""
    info = tp_info(engine.module)
    return (info.size, info.mesh.get_local_rank()) if info is not None else (1, 0)


def same_cut(engine, info: dict) -> bool:
    """Whether this engine's stages hold exactly the saved stages' parameters, split the same way."""
    parts = list(getattr(engine.module, "parts", []))
    return (info["num_stages"] == engine.num_stages and (not info.get("parts") or info["parts"] == parts)
            and int(info.get("tp_size", 1)) == tp_coords(engine)[0])


def restage(engine, root: Path, info: dict, out: Path) -> None:
    """Write under ``out`` -- a directory of the caller's, never inside ``root``: the checkpoint being read may be
    read-only, or read by other jobs at the same time -- a one-rank checkpoint (with its manifest) of exactly this
    stage's parameters (with tensor parallelism: this TP rank's pieces of them), found in the saved stages by name
    and re-cut from the saved TP ranks' pieces (reshard.write_recut). ``info``: the tag's pipeline.json."""
    saved_tp = int(info.get("tp_size", 1))
    tp, tp_rank = tp_coords(engine)
    cut = TPCut(saved_tp=saved_tp, tp=tp, tp_rank=tp_rank, saved_layouts=info.get("params", {}),
                current_layouts=param_layout(engine.module) if tp > 1 else {}, info_file=root / INFO)
    parts = [[root / "pipe" / stage_tag(s, r, saved_tp) / ZERO_TAG for r in range(saved_tp)]
             for s in range(info["num_stages"])]
    aliases = getattr(engine.module, "checkpoint_aliases", lambda: {})()
    write_recut(out, engine.groups, parts, cut=cut, parts_root=root / "pipe", aliases=aliases)
