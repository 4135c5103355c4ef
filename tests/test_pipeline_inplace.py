"""An in-place first layer on a pipeline stage (#26 item 2): ``nn.ReLU(inplace=True)`` right after the stage
boundary, as in DeepSpeedExamples' pipeline scripts.

The received activation is the autograd leaf whose gradient the stage sends back; an in-place op on it raises "a
leaf Variable that requires grad is being used in an in-place operation". DeepSpeed 0.19 trains it: its
``PipelineEngine._exec_forward_pass`` runs the stage on ``pipe_buffers['inputs'][buffer_id].clone()`` and sends the
leaf's ``.grad`` back, the gradient passing through the clone. hf_zero does the same (PipelineModule.run_chunk);
here 2 stages on 2 CPU ranks match one process training the same layers, loss by loss and parameter by parameter
(stage 0's parameters are right only if the gradient sent back through the in-place ReLU is).

DeepSpeed 0.19.8's run of this test (``scripts/ds_pattern_workers.py::pipeline_inplace``: the same layers, seeds,
data and config on its PipelineEngine, 2 CPU ranks, gloo): it trains, cut [0, 3, 6], losses 0.945940, 1.134867,
1.045106, eval 0.916075 -- and bit-identical numbers with an out-of-place ReLU, so the in-place layer changes nothing
there either. They are not the reference's (0.945940, 1.148873, 1.041914) because of gradient_clipping (0.04), not
the ReLU: with clipping off DeepSpeed's losses equal the unclipped one-process run (1.0722589 vs 1.0722588,
1.0849319), and its clipped run equals the reference clipped by stage 0's gradient norm alone (1.1348673,
1.0451057, eval 0.9160746): DeepSpeed's clip_grad_norm_ with the pipeline grid as mpu counts a parameter only where
``mpu.get_model_parallel_rank() == 0``, and the grid answers the rank in its pipe x tensor group, so stage 1's
gradients never enter the norm. hf_zero's numbers are torch's clip_grad_norm_ over every parameter, which is what
gradient_clipping means: DeepSpeed's pipeline clip is the wrong one (outside this pattern; its DP-only engine clips
right).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_zero.testing import run_distributed

from _pipe_util import CLIP, LR, MICRO, W, data, ds_config

STEPS, MICRO_BATCHES = 3, 2


def _layers():
    """Six layers; the uniform cut [0, 3, 6] puts the in-place ReLU first on stage 1."""
    from hf_zero.pipe import LayerSpec

    return [LayerSpec(nn.Linear, W, W), nn.Tanh(), LayerSpec(nn.Linear, W, W),
            nn.ReLU(inplace=True), LayerSpec(nn.Linear, W, W), LayerSpec(nn.Linear, W, W)]


def _train(schedules):
    import hf_zero
    from hf_zero.pipe import PipelineModule

    out = {}
    for schedule in schedules:
        net = PipelineModule(_layers(), num_stages=2, loss_fn=F.mse_loss, seed_layers=True,
                             partition_method="uniform")
        engine, *_ = hf_zero.initialize(model=net, config=ds_config(MICRO_BATCHES, 0, schedule))
        x, y = data(STEPS, MICRO_BATCHES, 1)
        losses = [engine.train_batch(iter([(x[s, j, 0], y[s, j, 0]) for j in range(MICRO_BATCHES)])).item()
                  for s in range(STEPS)]
        eval_loss = engine.eval_batch(iter([(x[0, j, 0], y[0, j, 0]) for j in range(MICRO_BATCHES)])).item()
        state = {f"{i}.{k}": v.clone() for i, sd in net.layer_state_dicts().items() for k, v in sd.items()}
        out[schedule] = dict(losses=losses, eval_loss=eval_loss, state=state, parts=list(net.parts))
        engine.destroy()
    return out


def _reference():
    """One process, the same layers and seeds (layer i built right after manual_seed(1234 + i)), SGD with the clip."""
    modules, forward = {}, []
    for idx, spec in enumerate(_layers()):
        torch.manual_seed(1234 + idx)
        f = spec.build() if hasattr(spec, "build") else spec
        if isinstance(f, nn.Linear):
            modules[idx] = f
        forward.append(f)
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    x, y = data(STEPS, MICRO_BATCHES, 1)

    def run(s):
        h = x[s].reshape(-1, W)
        for f in forward:
            h = f(h)
        return F.mse_loss(h, y[s].reshape(-1, W))

    losses = []
    for s in range(STEPS):
        loss = run(s)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        eval_loss = run(0).item()
    state = {f"{idx}.{n}": t.detach().clone() for idx, m in modules.items() for n, t in m.state_dict().items()}
    return losses, eval_loss, state


SCHEDULES = ["1f1b", "gpipe"]


def test_inplace_relu_first_on_stage_1_matches_one_process():
    assert MICRO == 2
    results = run_distributed(_train, world_size=2, args=(SCHEDULES,), timeout_s=300)
    ref_losses, ref_eval, ref_state = _reference()
    for schedule in SCHEDULES:
        assert results[0][schedule]["parts"] == [0, 3, 6]  # the ReLU (layer 3) opens stage 1
        merged = {}
        for rank, r in enumerate(results):
            per = r[schedule]
            assert per["losses"] == pytest.approx(ref_losses, rel=1e-5), (schedule, rank)
            assert per["eval_loss"] == pytest.approx(ref_eval, rel=1e-5), (schedule, rank)
            merged.update(per["state"])
        assert sorted(merged) == sorted(ref_state)
        for key, ref in ref_state.items():
            torch.testing.assert_close(merged[key], ref, rtol=1e-5, atol=1e-6, msg=f"{schedule}: {key}")
