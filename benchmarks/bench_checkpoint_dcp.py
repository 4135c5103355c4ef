"""hf_zero's checkpoint re-cut against torch.distributed.checkpoint (DCP), on the same ZeRO-2 state (issue #25).

    python benchmarks/bench_checkpoint_dcp.py                 # 32M parameters, AdamW, world 2, 3 repeats
    python benchmarks/bench_checkpoint_dcp.py --params 4e6 --repeats 2

One model of ``--params`` fp32 parameters (square Linear layers), ZeRO stage 2, AdamW, one step (so the moments
exist), on 2 CPU ranks (gloo). Timed, interleaved per repeat (A B A B ...), slowest rank's wall time:

* ``hf_zero save`` / ``load``: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (safetensors per rank,
  model.safetensors, meta.json, the atomic commit with fsync and sha256 manifest; the load verifies every file
  and loads masters, moments, module and counters);
* ``dcp save`` / ``load``: the same tensors as DCP would hold them -- each parameter's master and moments as a
  DTensor ``Shard(0)`` of its flat tensor over the 2 ranks (ZeRO's per-parameter cut is torch.chunk's), the
  module's state dict replicated -- written by ``dcp.save`` *inside hf_zero's commit* (checkpoint/commit.py: the
  same ``.tmp-<tag>``, fsync, sha256 manifest, rename) and read back by ``dcp.load`` after verifying every file
  against the manifest, then copied into flat shards (what the optimizer holds);
* then on 1 rank, the re-cut (world 2 -> 1): ``engine.load_checkpoint`` of the hf_zero tag, and ``dcp.load`` of
  the DCP tag into full tensors (verified first); the loaded masters are compared (they must be equal).

Prints one JSON line per measurement and a summary (median and range over repeats, seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_zero.testing import run_distributed  # noqa: E402


def _model(n_params: float) -> torch.nn.Module:
    """Square Linear layers of about ``n_params`` parameters in all (8 layers; width from the count)."""
    layers = 8
    width = int(math.sqrt(n_params / layers))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _engine(n_params: float):
    import hf_zero

    model = _model(n_params)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    width = model[0].in_features
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(1))
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine


def _names(engine) -> list[list[str]]:
    return [g["names"] for g in engine.optimizer.scalar_state()["groups"]]


def _dcp_state(engine, mesh) -> dict:
    """This rank's ZeRO state as DCP would hold it: per parameter and state, a DTensor Shard(0) of the flat tensor."""
    from torch.distributed.tensor import DTensor, Shard

    layouts = {prefix: (layout, rank) for prefix, layout, rank, _ in engine.optimizer.shard_layouts()}
    names = _names(engine)
    sd = {}
    for key, flat in engine.optimizer.shard_state().items():
        prefix = key.split(".")[0] + "."
        layout, rank = layouts[prefix]
        for i, name in enumerate(names[int(prefix[5:-1])]):
            lo, hi = layout.owned_range(i, rank)
            local = flat[layout.offsets[i]:layout.offsets[i] + (hi - lo)]
            sd[f"{key}/{name}"] = DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size([layout.numels[i]]),
                                                     stride=(1,))
    for name, t in engine.module.state_dict().items():
        sd[f"model/{name}"] = t
    return sd


def _dcp_save(engine, mesh, root: Path, tag: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hf_zero import comm
    from hf_zero.checkpoint.commit import agree, commit_tag
    from hf_zero.checkpoint.files import file_entry

    rank = dist.get_rank()
    sd = _dcp_state(engine, mesh)

    def write(tmp: Path):
        dcp.save(sd, checkpoint_id=tmp)
        mine = sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp")) + ([".metadata"] if rank == 0 else [])
        return {name: file_entry(tmp / name) for name in mine}, None

    commit_tag(root, tag, is_writer=rank == 0, domain=list(range(dist.get_world_size())), me=f"rank {rank}",
               agree=agree, barrier=lambda w: comm.barrier(None, what=w), write=write, save_latest=False,
               what=f"dcp save {tag}", label=f"dcp save {tag}")


def _verified(root: Path, tag: str) -> Path:
    from hf_zero.checkpoint.files import read_manifest, verify_files

    path = root / tag
    manifest = read_manifest(path)
    verify_files(path, manifest, sorted(manifest))  # every file, as hf_zero's load does when all are present
    return path


def _dcp_load_same_world(engine, mesh, root: Path, tag: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    template = _dcp_state(engine, mesh)
    sd = {k: (DTensor.from_local(torch.empty_like(v.to_local()), mesh, v.placements, shape=v.shape, stride=v.stride())
              if isinstance(v, DTensor) else torch.empty_like(v)) for k, v in template.items()}
    dcp.load(sd, checkpoint_id=_verified(root, tag))
    # into the flat shards the optimizer holds (hf_zero's load ends there too)
    flats = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            flats.setdefault(k.split("/")[0], []).append(v.to_local())
    for parts in flats.values():
        torch.cat(parts)


def _barrier_time(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def world2(n_params: float, root: str, repeats: int) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    engine = _engine(n_params)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    root = Path(root)
    rows = []
    for rep in range(repeats):
        hf_tag, dcp_tag = f"hf{rep}", f"dcp{rep}"
        rows.append({"rep": rep, "what": "hf_zero save",
                     "s": _barrier_time(lambda: engine.save_checkpoint(str(root / "hf"), tag=hf_tag))})
        rows.append({"rep": rep, "what": "dcp save", "s": _barrier_time(lambda: _dcp_save(engine, mesh, root / "dcp",
                                                                                           dcp_tag))})
        rows.append({"rep": rep, "what": "hf_zero load", "s": _barrier_time(
            lambda: engine.load_checkpoint(str(root / "hf"), tag=hf_tag))})
        rows.append({"rep": rep, "what": "dcp load", "s": _barrier_time(
            lambda: _dcp_load_same_world(engine, mesh, root / "dcp", dcp_tag))})
    return rows


def world1(n_params: float, root: str, repeats: int) -> dict:
    import torch.distributed.checkpoint as dcp

    engine = _engine(n_params)  # world 1: the saved 2-rank shards are re-cut
    root = Path(root)
    layouts = {prefix: layout for prefix, layout, _, _ in engine.optimizer.shard_layouts()}
    names = _names(engine)
    rows, masters = [], {}
    for rep in range(repeats):
        rows.append({"rep": rep, "what": "hf_zero re-cut load 2->1", "s": _barrier_time(
            lambda: engine.load_checkpoint(str(root / "hf"), tag=f"hf{rep}"))})
        sd = {}
        for key, flat in engine.optimizer.shard_state().items():
            prefix = key.split(".")[0] + "."
            for i, name in enumerate(names[int(prefix[5:-1])]):
                sd[f"{key}/{name}"] = torch.empty(layouts[prefix].numels[i], dtype=flat.dtype)
        for name, t in engine.module.state_dict().items():
            sd[f"model/{name}"] = torch.empty_like(t)
        rows.append({"rep": rep, "what": "dcp re-cut load 2->1", "s": _barrier_time(
            lambda: dcp.load(sd, checkpoint_id=_verified(root / "dcp", f"dcp{rep}")))})
        masters = {k: v for k, v in sd.items() if ".master/" in k}
    hf_master = engine.optimizer.shard_state()
    same = all(torch.equal(hf_master[k.split("/")[0]][layouts[k.split(".")[0] + "."].offsets[i]:
                                                      layouts[k.split(".")[0] + "."].offsets[i] + v.numel()], v)
               for k, v in masters.items()
               for i in [names[int(k.split(".")[0][5:])].index(k.split("/", 1)[1])])
    return {"rows": rows, "masters_equal": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=32e6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_dcp_") as root:
        two = run_distributed(world2, world_size=2, args=(args.params, root, args.repeats), timeout_s=1800)
        rows = [{**r, "s": max(rank_rows[i]["s"] for rank_rows in two)} for i, r in enumerate(two[0])]
        one = run_distributed(world1, world_size=1, args=(args.params, root, args.repeats), timeout_s=1800)[0]
        rows += one["rows"]
        sizes = {kind: sum(p.stat().st_size for p in (Path(root) / kind).rglob("*") if p.is_file()) / args.repeats
                 for kind in ("hf", "dcp")}
    for r in rows:
        print(json.dumps(r))
    summary = {}
    for what in dict.fromkeys(r["what"] for r in rows):
        s = [r["s"] for r in rows if r["what"] == what]
        summary[what] = f"median {statistics.median(s):.3f} s (range {min(s):.3f}-{max(s):.3f}, n={len(s)})"
    print(json.dumps({"params": args.params, "bytes_per_tag": sizes, "masters_equal_after_recut": one["masters_equal"],
                      "cpus": os.cpu_count(), "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
