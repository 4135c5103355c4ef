"""A DeepSpeed script that names its checkpoint directory per rank (a random suffix per process, one node): each
rank's files go where that rank was told, as DeepSpeed writes them (hf_zero refused this before, blaming storage not
shared between nodes). Each directory is complete for the ranks that wrote there: the same per-rank directories load
back exactly; one of them alone is refused naming the missing shards.

DeepSpeed 0.19.8 on the same pattern (DeepSpeedExamples' script on 2 CPU ranks): every rank writes its
``zero_pp_rank_R`` files into its own directory, rank 0 also the model states; the run completes.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.checkpoint.files import CheckpointError
from hf_zero.testing import run_distributed

from _parity import base_config, engine_run, make_model


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _per_rank(base: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = f"{base}/run-{rank}"  # what the script passes on this rank
    capture = _Capture()
    logging.getLogger("hf_zero").addHandler(capture)
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(2))
    engine_run(engine, world, rank, steps=2)
    engine.save_checkpoint(mine, tag="t")
    saved = [g.master.detach().clone() for g in engine.groups]
    engine.destroy()

    loaded = hf_zero.initialize(model=make_model(seed=3), config=base_config(2))[0]
    loaded.load_checkpoint(mine)  # the same per-rank directories: this rank's own shard is there
    same = all(torch.equal(a, g.master) for a, g in zip(saved, loaded.groups))
    steps = loaded.global_steps
    loaded.destroy()

    alone = hf_zero.initialize(model=make_model(seed=3), config=base_config(2))[0]
    try:
        alone.load_checkpoint(f"{base}/run-0")  # rank 0's directory holds rank 0's shard only
        error = None
    except CheckpointError as exc:
        error = str(exc)
    alone.destroy()
    logging.getLogger("hf_zero").removeHandler(capture)
    files = sorted(os.listdir(f"{mine}/t"))
    return dict(same=same, steps=steps, error=error, files=files, warned=[m for m in capture.messages
                                                                         if "different directories" in m])


def test_per_rank_directories_are_written_where_each_rank_says(tmp_path):
    outs = run_distributed(_per_rank, 2, args=(str(tmp_path),), timeout_s=240)
    for rank, out in enumerate(outs):
        assert out["same"] and out["steps"] == 2, out
        shards = [f for f in out["files"] if f.startswith("zero_rank")]
        assert len(shards) == 1 and str(rank) in shards[0], out["files"]
        assert "meta.json" in out["files"], out["files"]  # each directory is finalized by its own writer
    assert len(outs[0]["warned"]) == 1 and "run-0" in outs[0]["warned"][0] and "run-1" in outs[0]["warned"][0]
    assert outs[1]["warned"] == []
    # loading rank 0's directory on both ranks: rank 1's shard is not there, and the error says why
    assert outs[1]["error"] is not None and "per-rank directories" in outs[1]["error"], outs[1]["error"]
