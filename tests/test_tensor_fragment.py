"""``deepspeed.utils.safe_get_full_grad`` and friends at ZeRO stages 0-3 on 2 ranks, against plain torch on one
process: the full gradient after backward, the fp32 weights and Adam's moments after a step; setters change what
the next step computes with; local chunks reassemble the full tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.testing import run_distributed

IN, HID, OUT, BATCH = 5, 7, 3, 4  # odd sizes: every parameter is padded over 2 ranks
LR = 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2 * BATCH, IN, generator=g), torch.randn(2 * BATCH, OUT, generator=g)


def _reference():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = _data()
    nn.functional.mse_loss(model(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, \
        {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}


def _rank_fn(stages):
    return {stage: _one_stage(*stage) if isinstance(stage, tuple) else _one_stage(stage) for stage in stages}


def _one_stage(stage: int, offload: str | None = None):
    import deepspeed  # hf_zero's compatibility layer
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_optimizer_state,
                                 safe_set_local_fp32_param)

    rank = torch.distributed.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0}}, "steps_per_print": 1000}
    if offload:  # the master and moments in the optimizer offload: read back from there, written back there
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload}
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    x, y = _data()
    loss = nn.functional.mse_loss(engine(x[rank * BATCH:(rank + 1) * BATCH]), y[rank * BATCH:(rank + 1) * BATCH])
    before = {n: safe_get_full_grad(params[n]) for n in names}  # not yet reduced at stages 0/1: None
    engine.backward(loss)
    out = {"grad": {n: safe_get_full_grad(params[n]) for n in names},
           "local_grad": {n: safe_get_local_grad(params[n]) for n in names},
           "grad_before_backward": before}
    engine.step()
    out["fp32"] = {n: safe_get_full_fp32_param(params[n]) for n in names}
    out["local_fp32"] = {n: safe_get_local_fp32_param(params[n]) for n in names}
    out["exp_avg"] = {n: safe_get_full_optimizer_state(params[n], "exp_avg") for n in names}
    out["exp_avg_sq"] = {n: safe_get_full_optimizer_state(params[n], "exp_avg_sq") for n in names}
    out["local_exp_avg"] = {n: safe_get_local_optimizer_state(params[n], "exp_avg") for n in names}
    out["step"] = safe_get_full_optimizer_state(params["0.weight"], "step")
    out["grad_after_step"] = safe_get_full_grad(params["0.weight"])
    try:
        safe_get_full_optimizer_state(params["0.weight"], "momentum_buffer")
    except KeyError as exc:
        out["bad_key"] = str(exc)

    # setters: the next forward computes with the new weights; state reads back
    safe_set_full_fp32_param(params["2.weight"], torch.full((OUT, HID), 0.5))
    safe_set_full_optimizer_state(params["2.weight"], torch.full((OUT, HID), 2.0), "exp_avg")
    out["set_fp32"] = safe_get_full_fp32_param(params["2.weight"])
    out["set_exp_avg"] = safe_get_full_optimizer_state(params["2.weight"], "exp_avg")
    with torch.no_grad():
        h = torch.ones(1, IN)
        out["forward_after_set"] = engine(h).float()
    try:
        chunk = safe_get_local_fp32_param(params["0.bias"])
        safe_set_local_fp32_param(params["0.bias"], torch.full_like(chunk, float(rank + 1)))
        out["local_set"] = safe_get_full_fp32_param(params["0.bias"])
    except ValueError as exc:
        out["local_set_refused"] = str(exc)
    out["frozen"] = safe_get_full_fp32_param(nn.Parameter(torch.zeros(2)))
    engine.destroy()
    return out


def _reassemble(chunks, numel, shape):
    return torch.cat(chunks)[:numel].reshape(shape)


SPECS = (0, 1, 2, 3, (2, "cpu"), (3, "cpu"))  # the last two: offload_optimizer cpu


@pytest.fixture(scope="module")
def per_stage():
    """One pair of processes runs every case (process start-up dominates the cost)."""
    per_rank = run_distributed(_rank_fn, world_size=2, args=(SPECS,), timeout_s=400)
    return {spec: [r[spec] for r in per_rank] for spec in SPECS}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0]}-offload" if isinstance(s, tuple) else str(s))
def test_safe_get_set_at_every_stage(per_stage, spec):
    stage = spec[0] if isinstance(spec, tuple) else spec
    grads, params, states = _reference()
    results = per_stage[spec]
    for rank, out in enumerate(results):
        for n in grads:
            torch.testing.assert_close(out["grad"][n], grads[n], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["fp32"][n], params[n], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["exp_avg"][n], states[n]["exp_avg"], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(out["exp_avg_sq"][n], states[n]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
            if stage < 2:  # stages 0/1 reduce only at the boundary: before that, this rank's own gradient
                assert out["grad_before_backward"][n] is None
        assert float(out["step"]) == 1.0
        # step() cleared the reduced gradient: freed at stages 0-2, zeroed in place at stage 3
        if stage < 3:
            assert out["grad_after_step"] is None
        else:
            assert torch.count_nonzero(out["grad_after_step"]) == 0
        assert "momentum_buffer" in out["bad_key"] and "exp_avg" in out["bad_key"]
        torch.testing.assert_close(out["set_fp32"], torch.full((OUT, HID), 0.5))
        torch.testing.assert_close(out["set_exp_avg"], torch.full((OUT, HID), 2.0))
        model = _model()
        model.load_state_dict(params)
        with torch.no_grad():
            model[2].weight.fill_(0.5)
            expected = model(torch.ones(1, IN))
        torch.testing.assert_close(out["forward_after_set"], expected, rtol=1e-5, atol=1e-6)
        assert out["frozen"] is None
    for n in grads:
        numel, shape = params[n].numel(), params[n].shape
        if stage == 0:  # a world of one per rank: the local chunk is the whole parameter
            for out in results:
                torch.testing.assert_close(out["local_fp32"][n].reshape(shape), params[n])
            continue
        torch.testing.assert_close(_reassemble([o["local_fp32"][n] for o in results], numel, shape), params[n])
        torch.testing.assert_close(_reassemble([o["local_grad"][n] for o in results], numel, shape), grads[n],
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(_reassemble([o["local_exp_avg"][n] for o in results], numel, shape),
                                   states[n]["exp_avg"], rtol=1e-5, atol=1e-7)
    if stage == 3:  # each rank wrote its own chunk: ranks 0 and 1 hold elements [0, 4) and [4, 7)
        expected = torch.tensor([1.0] * 4 + [2.0] * 3)
        for out in results:
            torch.testing.assert_close(out["local_set"], expected)
    else:
        assert all("use safe_set_full_fp32_param" in out["local_set_refused"] for out in results)


def test_registry_does_not_keep_a_dropped_engine_alive(monkeypatch):
    """The parameter -> shard registry holds neither the engine's optimizer nor its parameters."""
    import gc
    import weakref

    import hf_zero
    from hf_zero.zero.tensor_fragment import safe_get_full_fp32_param

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    model = nn.Linear(4, 2)
    engine = hf_zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
    torch.testing.assert_close(safe_get_full_fp32_param(model.weight), model.weight.detach())
    optimizer, weight = weakref.ref(engine.optimizer), weakref.ref(model.weight)
    engine.destroy()
    del engine, model
    gc.collect()
    assert optimizer() is None and weight() is None
