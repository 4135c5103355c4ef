"""Pipeline checkpoints reload on another cut: written on 2 stages (AdamW, so optimizer state matters), reloaded on
4 stages and on 1 stage x 2 replicas (ZeRO-1), training continues on the one-process reference's loss curve.

The tag is atomic as a whole: a re-save of the same tag one step later that fails on stage 1 (its layer file's
write) raises on both ranks within seconds, naming rank 1, and leaves every byte of the saved tag as it was; a
second re-save that crashes between its two renames leaves the previous tag as .old-<tag> -- which the reloads
above read. A truncated layer file and an edited pipeline.json (still valid JSON) are refused on every
rank, naming the file, before any parameter changes."""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from hf_zero.testing import run_distributed

from _pipe_util import ADAM, data, ds_config, layer_list, reference_run

M = 2  # micro-batches per step when saving; 4 global rows of data per step


def _run(ckpt: str, stages: int, zero: int, start: int, steps: int, save: bool, refusals: bool = False):
    import hf_zero
    from hf_zero.pipe import PipelineModule

    net = PipelineModule(layer_list(True), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                         partition_method="uniform")
    world = torch.distributed.get_world_size()
    dp = world // stages
    m = M // dp  # the same global batch: replicas split the micro-batches
    engine, *_ = hf_zero.initialize(model=net, config=ds_config(m, zero, "gpipe", optimizer=ADAM))
    d = engine.grid.data_parallel_id
    refused = _refusals(engine, net, ckpt) if refusals else None
    if start:
        engine.load_checkpoint(ckpt)
    x, y = data(3, M, 1)  # the same tensors in every launch (the reference trains 3 steps)
    losses = []
    for s in range(start, start + steps):
        micro = [(x[s, d * m + j, 0], y[s, d * m + j, 0]) for j in range(m)]
        losses.append(engine.train_batch(iter(micro)).item())
    if engine.stage3 is not None:
        raise AssertionError("not used with ZeRO-3 here")
    state = {f"{i}.{k}": v.clone() for i, sd in net.layer_state_dicts().items() for k, v in sd.items()}
    failed = None
    if save:
        engine.save_checkpoint(ckpt)
        micro = [(x[2, d * m + j, 0], y[2, d * m + j, 0]) for j in range(m)]
        engine.train_batch(iter(micro))  # every tensor moves: a re-save that got through would show
        failed = _failed_resave(engine, ckpt, f"global_step{start + steps}")
    return losses, state, engine.global_steps, failed or refused


def _digests(path: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), path): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(path) for f in files}


def _failed_resave(engine, ckpt: str, tag: str):
    """Re-save ``tag`` with stage 1's layer-file write failing half-way (a full disk)."""
    import torch.distributed as dist

    before = _digests(ckpt)
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if "layer_" in str(f):
            real_save(obj, f, *args, **kwargs)
            os.truncate(f, 10)
            raise OSError("disk full (injected)")
        return real_save(obj, f, *args, **kwargs)

    if dist.get_rank() == 1:
        torch.save = failing_save
    start = time.monotonic()
    try:
        engine.save_checkpoint(ckpt, tag=tag)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    finally:
        torch.save = real_save
    seconds, unchanged, listing = time.monotonic() - start, before == _digests(ckpt), sorted(os.listdir(ckpt))
    return error, seconds, unchanged, listing, _crash_between_renames(engine, ckpt, tag)


def _crash_between_renames(engine, ckpt: str, tag: str):
    """Rank 0 dies (here: raises) after renaming the previous tag to .old-<tag> and before renaming the new one into
    place: the reloads must then read the .old- copy, the previous checkpoint."""
    import hf_zero.checkpoint.commit as commit

    real = commit._rename

    def crash_before_publishing(src, dst):  # the stages' own checkpoints inside the tag rename their .tmp-zero as usual
        if src.name == f".tmp-{tag}":
            raise OSError("simulated crash between the renames")
        real(src, dst)

    commit._rename = crash_before_publishing
    try:
        engine.save_checkpoint(ckpt, tag=tag)
        error = None
    except (OSError, RuntimeError) as exc:
        error = str(exc)
    finally:
        commit._rename = real
    return error, sorted(os.listdir(ckpt))


def _refusals(engine, net, ckpt: str) -> dict:
    """Broken copies of the checkpoint: every rank refuses naming the file, and no parameter moved."""
    import torch.distributed as dist

    from hf_zero.checkpoint.files import CheckpointError

    tag = open(os.path.join(ckpt, "latest")).read()
    out = {}
    for name in ("layer_01-model_states.pt", "pipeline.json"):
        broken = f"{ckpt}-broken-{name}"
        if dist.get_rank() == 0:
            shutil.copytree(ckpt, broken)
            path = os.path.join(broken, f".old-{tag}", name)  # the previous copy, after the crash above
            data = open(path, "rb").read()
            edited = data[:len(data) // 2] if name.endswith(".pt") else \
                data.replace(b'"num_stages": 2', b'"num_stages": 4')  # still valid JSON: only the checksum tells
            assert edited != data
            open(path, "wb").write(edited)
        dist.barrier()
        before = [p.detach().clone() for p in net.parameters()]
        try:
            engine.load_checkpoint(broken)
            out[name] = "loaded"
        except CheckpointError as exc:
            out[name] = str(exc)
        out[name + " unchanged"] = all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    return out


def test_checkpoint_from_two_stages_continues_on_four_and_on_one(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ref_losses, _, ref_state, _ = reference_run(True, 3, M, 1, adam=True)
    saved = run_distributed(_run, world_size=2, args=(ckpt, 2, 0, 0, 2, True), timeout_s=300)
    assert saved[0][0] == pytest.approx(ref_losses[:2], rel=1e-5)
    for rank, (_, _, _, (error, seconds, unchanged, listing, (crash, after_crash))) in enumerate(saved):
        # the failed re-save of the same tag: every rank names rank 1 and its error, at once, and nothing moved
        assert error is not None and "failed on rank 1 (stage 1, replica 0)" in error, (rank, error)
        assert "disk full (injected)" in error and "previous checkpoint is untouched" in error, (rank, error)
        assert seconds < 30, (rank, seconds)
        assert unchanged and listing == ["global_step2", "latest"], (rank, listing)
        # a crash between the renames of the next re-save: the previous tag survives as .old-global_step2, which
        # the reloads below read
        assert "simulated crash between the renames" in crash, (rank, crash)
        assert rank == 0 or "failed to finalize on rank 0 (stage 0, replica 0)" in crash, (rank, crash)
        assert after_crash == [".old-global_step2", ".tmp-global_step2", "latest"], (rank, after_crash)
    for stages, world, zero in ((4, 4, 0), (1, 2, 1)):
        results = run_distributed(_run, world_size=world, args=(ckpt, stages, zero, 2, 1, False, stages == 1),
                                  timeout_s=300)
        merged = {}
        for losses, state, global_steps, refused in results:
            assert global_steps == 3
            assert losses == pytest.approx(ref_losses[2:], rel=1e-5), (stages, world)
            merged.update(state)
            if refused is not None:
                assert "layer_01-model_states.pt" in refused["layer_01-model_states.pt"], refused
                assert "truncated" in refused["layer_01-model_states.pt"], refused
                assert "pipeline.json" in refused["pipeline.json"] and "sha256" in refused["pipeline.json"], refused
                assert refused["layer_01-model_states.pt unchanged"] and refused["pipeline.json unchanged"]
        assert sorted(merged) == sorted(ref_state)
        for key, ref in ref_state.items():
            torch.testing.assert_close(merged[key], ref, rtol=1e-4, atol=1e-5, msg=f"{stages} stages: {key}")
