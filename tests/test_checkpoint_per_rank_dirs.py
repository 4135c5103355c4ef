"""A DeepSpeed script that names its checkpoint directory per rank (a random suffix per process, one node): each
rank's files go where that rank was told, as DeepSpeed writes them (hf_zero refused this before, blaming storage not
shared between nodes). Each directory is complete for the ranks that wrote there: the same per-rank directories load
back exactly; one of them alone is refused naming the missing shards.

DeepSpeed 0.19.8 on the same pattern (DeepSpeedExamples' script on 2 CPU ranks): every rank writes its
``zero_pp_rank_R`` files into its own directory, rank 0 also the model states; the run completes.
DeepSpeed's run of this test (scripts/ds_pattern_workers.py::per_rank_dirs, same model, config and steps, 2 CPU
ranks): run-0/t holds mp_rank_00_model_states.pt and zero_pp_rank_0's optimizer states, run-0 also ``latest`` and the
zero_to_fp32.py script; run-1/t holds only zero_pp_rank_1's optimizer states and run-1 no ``latest``. Loading back:
rank 0 restores its directory exactly (2 steps), rank 1 loads nothing ("Unable to find latest file at .../run-1/latest",
load_checkpoint returns None, global_steps 0); loading run-0 on rank 1 raises FileNotFoundError for
zero_pp_rank_1_mp_rank_00_optim_states.pt. hf_zero writes the same per-rank files and also finalizes each directory
(meta.json, latest), so both ranks load their own back exactly and the rank-0-only load is refused by name: the save
is DeepSpeed's, the load is what a user of these directories needs.
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
