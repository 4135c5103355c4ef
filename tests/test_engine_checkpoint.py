"""Checkpoints: exact resume, resume on another world size, atomic saves, client state."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_zero
import hf_zero.checkpoint.engine as ckpt
from hf_zero.testing import run_distributed

from _parity import base_config, clone_state, engine_run, full_optimizer_state, make_model


def _save_then_continue(stage, save_dir):
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(stage))
    engine_run(engine, world, rank, steps=4)
    engine.save_checkpoint(save_dir, client_state={"epoch": 3, "note": "hi"})
    saved = {k: full_optimizer_state(engine, k) for k in ("master", "exp_avg", "exp_avg_sq")}
    losses = engine_run(engine, world, rank, steps=5, start=4)
    return losses, clone_state(engine), saved, engine.global_steps


def _load_then_continue(stage, save_dir, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # a different initialization: everything must come from the checkpoint
    engine, *_ = hf_zero.initialize(model=make_model(seed=99), config=base_config(stage))
    path, client = engine.load_checkpoint(save_dir)
    loaded = {k: full_optimizer_state(engine, k) for k in ("master", "exp_avg", "exp_avg_sq")}
    step_at_load = engine.global_steps
    losses = engine_run(engine, world, rank, steps=steps, start=4) if steps else []
    return path, client, loaded, step_at_load, losses, clone_state(engine)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_matches_uninterrupted_run_and_reshards(stage, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    uninterrupted = run_distributed(_save_then_continue, 2, args=(stage, save_dir))
    losses, params, saved, _ = uninterrupted[0]
    assert (Path(save_dir) / "latest").read_text() == "global_step4"
    files = sorted(os.listdir(Path(save_dir) / "global_step4"))
    model_file = ["model.safetensors"] if stage < 3 else []  # stage 3: every rank's file holds its shards
    assert files == ["engine_state.pt", "manifest.json", "meta.json", *model_file, "zero_rank00000.safetensors",
                     "zero_rank00001.safetensors"]

    resumed = run_distributed(_load_then_continue, 2, args=(stage, save_dir, 5))
    path, client, loaded, step_at_load, r_losses, r_params = resumed[0]
    assert path.endswith("global_step4") and client == {"epoch": 3, "note": "hi"} and step_at_load == 4
    assert r_losses == losses  # exact: same ranks, same shards, same order of operations
    for name in params:
        torch.testing.assert_close(r_params[name], params[name], rtol=0, atol=0)

    # the same checkpoint on 4 ranks and on 1: optimizer state re-cut, every full tensor identical
    for world in (4, 1):
        out = run_distributed(_load_then_continue, world, args=(stage, save_dir, 0))
        for r in range(world):
            for key in saved:
                for name, t in saved[key].items():
                    torch.testing.assert_close(out[r][2][key][name], t, rtol=0, atol=0,
                                               msg=lambda m: f"world {world} rank {r} {key} {name}: {m}")


def _interrupted_save(save_dir):
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(2))
    engine_run(engine, world, rank, steps=2)
    engine.save_checkpoint(save_dir)
    good = clone_state(engine)
    engine_run(engine, world, rank, steps=1, start=2)
    real_save_file = ckpt.save_file

    def failing_save_file(tensors, filename, metadata=None):
        if rank == 1 and "zero_rank" in str(filename):
            real_save_file(tensors, filename, metadata=metadata)
            with open(filename, "r+b") as f:  # a half-written file, then the "crash"
                f.truncate(10)
            raise OSError("disk full (injected)")
        return real_save_file(tensors, filename, metadata=metadata)

    ckpt.save_file = failing_save_file
    try:
        engine.save_checkpoint(save_dir)
        raised = None
    except RuntimeError as err:
        raised = str(err)
    finally:
        ckpt.save_file = real_save_file
    fresh, *_ = hf_zero.initialize(model=make_model(seed=5), config=base_config(2))
    path, _ = fresh.load_checkpoint(save_dir)
    return raised, path, good, clone_state(fresh), sorted(os.listdir(save_dir))


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(_interrupted_save, 2, args=(save_dir,))
    for raised, path, good, loaded, listing in results:
        assert raised is not None and "failed on rank 1" in raised and "previous checkpoint is untouched" in raised
        assert path.endswith("global_step2")
        assert listing == ["global_step2", "latest", "zero_to_fp32.py"]
        for name in good:
            torch.testing.assert_close(loaded[name], good[name], rtol=0, atol=0)


def _load_missing(save_dir):
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(1))
    return engine.load_checkpoint(save_dir)


def test_load_without_latest_returns_none(tmp_path):
    assert run_distributed(_load_missing, 1, args=(str(tmp_path),)) == [(None, None)]
