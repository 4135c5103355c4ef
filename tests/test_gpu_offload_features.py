"""On a real GPU (in this process, a world of one as hf_zero.initialize makes it): ZenFlow at stages 2 and 3
(selective updates of CUDA weights, the offloaded step on the CPU; at stage 3 also with the shards in host memory)
and bf16 master weights with ``offload_optimizer: cpu`` (the bf16 masters in host memory, copied up after each
tile).

Marked ``gpu``: skipped where CUDA is not available (CI); ``scripts/gpu_check.sh`` runs them. One process each.
The references are the CPU runs these features are proven against in ``tests/test_zenflow.py`` and
``tests/test_offload_bf16_master.py``; a GPU's matmuls and fused kernels round differently from the CPU's, so the
tolerances are fp32's (ZenFlow) and one bf16 unit (bf16 masters).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import hf_zero

sys.path.insert(0, os.path.dirname(__file__))
import test_zenflow as zf  # noqa: E402
from _parity import GAS, base_config, make_data, make_model  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")]


def _zenflow_run(stage: int, offload_param: str | None = None) -> dict:
    cfg = zf._config("fp32", zf.CASES["fixed"]["zenflow"], stage=stage)
    if offload_param:  # the shards in host memory, the selective update there
        cfg["zero_optimization"]["offload_param"] = {"device": offload_param}
    model = zf._model()
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for xs, ys in zf._batches(1, 8):
        loss = zf._loss(engine(xs[:zf.MICRO].to(engine.device)), ys[:zf.MICRO].to(engine.device), torch.float32)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().float().cpu().clone() for p in engine.module.parameters()]
    placed = {p.device.type for p in engine.module.parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "placed": placed}


@pytest.mark.parametrize("stage, offload_param", [(2, None), (3, None), (3, "cpu")])
def test_zenflow_on_the_gpu_matches_the_reference(stage, offload_param):
    got = _zenflow_run(stage, offload_param)
    ref = zf.zenflow_reference(world=1, steps=8, stage3=stage == 3, **zf.CASES["fixed"])
    assert got["placed"] == {"cuda"}
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-5)
    for a, b in zip(got["params"], ref["params"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _bf16_master_run(stage: int, offload: bool) -> dict:
    cfg = base_config(stage, bf16={"enabled": True, "bf16_master_weights_and_grads": True})
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    engine, *_ = hf_zero.initialize(model=make_model(), config=cfg)
    x, y = make_data(1, 5)
    losses = []
    for s in range(5):
        for m in range(GAS):
            out = engine(x[s, m, 0].to(engine.device, torch.bfloat16))
            loss = torch.nn.functional.mse_loss(out.float(), y[s, m, 0].to(engine.device))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().float().cpu().clone() for p in engine.module.parameters()]
    offloaded = engine.optimizer.offload is not None and all(
        t.device.type == "cpu" for h in engine.optimizer.offload._host for t in h.values())
    engine.destroy()
    return {"losses": losses, "params": params, "offloaded": offloaded}


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_masters_offloaded_from_the_gpu_train_as_on_the_gpu(stage):
    on_gpu, offloaded = _bf16_master_run(stage, False), _bf16_master_run(stage, True)
    assert offloaded["offloaded"]
    assert offloaded["losses"] == pytest.approx(on_gpu["losses"], rel=2.0 ** -7)
    for a, b in zip(offloaded["params"], on_gpu["params"]):
        torch.testing.assert_close(a, b, rtol=2.0 ** -7, atol=2.0 ** -7)
