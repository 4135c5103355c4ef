"""Pipeline checkpoints reload on another cut: written on 2 stages (AdamW, so optimizer state matters), reloaded on
4 stages and on 1 stage x 2 replicas (ZeRO-1), training continues on the one-process reference's loss curve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_zero.testing import run_distributed

from _pipe_util import ADAM, data, ds_config, layer_list, reference_run

M = 2  # micro-batches per step when saving; 4 global rows of data per step


def _run(ckpt: str, stages: int, zero: int, start: int, steps: int, save: bool):
    import hf_zero
    from hf_zero.pipe import PipelineModule

    net = PipelineModule(layer_list(True), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                         partition_method="uniform")
    world = torch.distributed.get_world_size()
    dp = world // stages
    m = M // dp  # the same global batch: replicas split the micro-batches
    engine, *_ = hf_zero.initialize(model=net, config=ds_config(m, zero, "gpipe", optimizer=ADAM))
    d = engine.grid.data_parallel_id
    if start:
        engine.load_checkpoint(ckpt)
    x, y = data(3, M, 1)  # the same tensors in every launch (the reference trains 3 steps)
    losses = []
    for s in range(start, start + steps):
        micro = [(x[s, d * m + j, 0], y[s, d * m + j, 0]) for j in range(m)]
        losses.append(engine.train_batch(iter(micro)).item())
    if save:
        engine.save_checkpoint(ckpt)
    if engine.stage3 is not None:
        raise AssertionError("not used with ZeRO-3 here")
    state = {f"{i}.{k}": v.clone() for i, sd in net.layer_state_dicts().items() for k, v in sd.items()}
    return losses, state, engine.global_steps


def test_checkpoint_from_two_stages_continues_on_four_and_on_one(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ref_losses, _, ref_state, _ = reference_run(True, 3, M, 1, adam=True)
    saved = run_distributed(_run, world_size=2, args=(ckpt, 2, 0, 0, 2, True), timeout_s=300)
    assert saved[0][0] == pytest.approx(ref_losses[:2], rel=1e-5)
    for stages, world, zero in ((4, 4, 0), (1, 2, 1)):
        results = run_distributed(_run, world_size=world, args=(ckpt, stages, zero, 2, 1, False), timeout_s=300)
        merged = {}
        for losses, state, global_steps in results:
            assert global_steps == 3
            assert losses == pytest.approx(ref_losses[2:], rel=1e-5), (stages, world)
            merged.update(state)
        assert sorted(merged) == sorted(ref_state)
        for key, ref in ref_state.items():
            torch.testing.assert_close(merged[key], ref, rtol=1e-4, atol=1e-5, msg=f"{stages} stages: {key}")
