"""``engine.offload_states()`` / ``engine.reload_states()`` with DeepSpeed's enums, ZeRO stages 0, 2 and 3 on 2 ranks.

This machine has no accelerator, so every state already lives in host memory: a real offload moves nothing, and
that is asserted. The move itself (storage replaced, views re-pointed, old storage no longer referenced) is what a
GPU run does; it is exercised here by making the offloader copy even onto the same device, and training after
offload + reload must equal training without it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.testing import run_distributed

STEPS = 2


def _engine(stage: int):
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 11), nn.Tanh(), nn.Linear(11, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter: an lp_param without optimizer state
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
           "bf16": {"enabled": stage == 3},  # a separate 16-bit shard (lp_params) at stage 3
           "optimizer": {"type": "Adam", "params": {"lr": 0.05}}, "steps_per_print": 1000}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _train(engine, start: int) -> list[float]:
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2 * STEPS, 8, 5, generator=g), torch.randn(2 * STEPS, 8, 3, generator=g)
    losses = []
    for s in range(start, start + STEPS):
        out = engine(x[s, rank * 4:(rank + 1) * 4].to(engine.compute_dtype))
        loss = nn.functional.mse_loss(out.float(), y[s, rank * 4:(rank + 1) * 4])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _live_storages(engine) -> list:
    """The storages every structure the engine computes with points into."""
    from hf_zero.zero.stage3.param import sharded_param_of

    tensors = []
    for g in engine.groups:
        tensors += [g.master, g.grad]
        for p in g.params:
            sp = sharded_param_of(p)
            tensors += [sp.local_shard, sp.grad_storage] if sp is not None else [p]
    # empty tensors (a freed gradient shard) have no storage
    return [t.untyped_storage() for t in tensors if t.numel()]


def _state_bytes(engine) -> int:
    offloader = engine._state_offloader()
    from hf_zero.zero.state_offload import OffloadStateTypeEnum

    return sum(t.numel() * t.element_size() for kind in OffloadStateTypeEnum for t in offloader._tensors(kind))


def _stage(stage: int) -> dict:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    out = {}
    reference = _engine(stage)
    out["reference"] = _train(reference, 0) + _train(reference, STEPS)
    reference.destroy()

    # the real thing on this CPU-only machine: nothing moves, everything stays usable
    engine = _engine(stage)
    out["plain"] = _train(engine, 0)
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states], device=OffloadDeviceEnum.cpu)
    out["plain_kinds"] = sorted(k.value for k in engine._offloader.offloaded)
    out["plain_moved"] = engine._offloader.moved_bytes
    engine.offload_states()  # the rest; optim_states is already offloaded and is skipped
    out["plain_all_kinds"] = sorted(k.value for k in engine._offloader.offloaded)
    engine.reload_states()
    out["plain_after_reload"] = sorted(engine._offloader.offloaded)
    out["plain"] += _train(engine, STEPS)
    for bad in (dict(include=["weights"]), dict(device=OffloadDeviceEnum.nvme)):
        try:
            engine.offload_states(**bad)
        except ValueError as exc:
            out.setdefault("errors", []).append(str(exc))
    engine.destroy()

    # the move a GPU run makes: storage replaced (copied even onto the same device) and views re-pointed
    engine = _engine(stage)
    first = _train(engine, 0)
    engine._state_offloader()._always_copy = True
    # holding the old storages keeps their addresses from being reused by the new allocations
    before = _live_storages(engine)
    expected = _state_bytes(engine)
    engine.offload_states()
    out["moved_out"], out["expected_bytes"] = engine._offloader.moved_bytes, expected
    after = {s.data_ptr() for s in _live_storages(engine)}
    out["old_storage_still_referenced"] = sorted({s.data_ptr() for s in before} & after)
    del before
    engine.reload_states()
    out["moved_back"] = engine._offloader.moved_bytes
    out["copied"] = first + _train(engine, STEPS)
    engine.destroy()
    return out


def _ranks():
    return {stage: _stage(stage) for stage in (0, 2, 3)}


@pytest.fixture(scope="module")
def per_stage():
    results = run_distributed(_ranks, world_size=2, timeout_s=400)
    return {stage: [r[stage] for r in results] for stage in (0, 2, 3)}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_offload_and_reload_states(per_stage, stage):
    all_kinds = ["contiguous_grad_buffer", "hp_params", "lp_grads", "lp_params", "optim_states"]
    for out in per_stage[stage]:
        assert out["plain_kinds"] == ["optim_states"] and out["plain_all_kinds"] == all_kinds
        assert out["plain_moved"] == 0  # CPU-only: the states are in host memory already
        assert out["plain_after_reload"] == []
        assert out["plain"] == pytest.approx(out["reference"], rel=1e-6)
        assert "unknown state type 'weights'" in out["errors"][0] and "only OffloadDeviceEnum.cpu" in out["errors"][1]
        # every state byte moved out and back, no structure kept pointing at the old storage, and training after
        # the round trip is the training without it
        assert out["moved_out"] == out["moved_back"] == out["expected_bytes"] > 0
        assert out["old_storage_still_referenced"] == []
        assert out["copied"] == pytest.approx(out["reference"], rel=1e-6)
