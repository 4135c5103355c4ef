"""Failure behaviour of the pipeline engine (2 ranks = 2 stages).

- A stage that raises ends the other stage too, within seconds (not at the 30-minute collective timeout), with an
  error naming the failing stage, its rank and the original exception.
- A batch whose shape changes between steps is refused with a message naming what to set, or, with
  ``dynamic_shape=True``, trains and matches the one-process reference.
- Calls a pipeline engine does not offer raise PipelineError; 1F1B with fewer micro-batches than stages is refused
  naming gradient_accumulation_steps.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_zero.testing import run_distributed

from _pipe_util import MICRO, W, ds_config, layer_list, reference_params


class Boom(nn.Module):
    calls = 0

    def forward(self, x):
        Boom.calls += 1
        if Boom.calls == 3:  # step 2, first micro-batch
            raise RuntimeError("boom in the layer")
        return x


def _fail_fast():
    import hf_zero
    from hf_zero.pipe import PipelineModule

    net = PipelineModule(layer_list(False, n_hidden=1) + [Boom()], num_stages=2, loss_fn=F.mse_loss,
                         seed_layers=True, partition_method="uniform")
    engine, *_ = hf_zero.initialize(model=net, config=ds_config(2))
    x = torch.randn(2, MICRO, W)
    for _ in range(3):
        start = time.monotonic()
        try:
            engine.train_batch(iter([(x[0], x[0]), (x[1], x[1])]))
        except Exception as exc:  # noqa: BLE001 - the test inspects whatever each rank got
            return type(exc).__name__, str(exc), time.monotonic() - start
    return None


def test_a_failing_stage_ends_every_stage_with_its_name_and_rank():
    results = run_distributed(_fail_fast, world_size=2, timeout_s=300)
    (kind0, msg0, t0), (kind1, msg1, t1) = results
    failed = "pipeline stage 1 (global rank 1) failed in train_batch: RuntimeError: boom in the layer"
    assert (kind1, msg1) == ("PipelineStageFailure", failed)
    assert kind0 == "PipelineStageFailure"
    assert failed in msg0, msg0
    assert "pipeline stage 0 (global rank 0)" in msg0
    assert t0 < 30 and t1 < 30, (t0, t1)


def _shapes(dynamic: bool):
    import hf_zero
    from hf_zero.pipe import PipelineModule

    net = PipelineModule(layer_list(False), num_stages=2, loss_fn=F.mse_loss, seed_layers=True,
                         dynamic_shape=dynamic)
    engine, *_ = hf_zero.initialize(model=net, config=ds_config(2))
    g = torch.Generator().manual_seed(9)
    losses = []
    for rows in (MICRO, MICRO + 3):  # the micro-batch grows between steps
        x, y = torch.randn(2, rows, W, generator=g), torch.randn(2, rows, W, generator=g)
        try:
            losses.append(engine.train_batch(iter([(x[0], y[0]), (x[1], y[1])])).item())
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc)
    return losses


def _reference_dynamic():
    modules, forward = reference_params(False)
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.2)
    g = torch.Generator().manual_seed(9)
    losses = []
    for rows in (MICRO, MICRO + 3):
        x, y = torch.randn(2, rows, W, generator=g), torch.randn(2, rows, W, generator=g)
        h = x.reshape(-1, W)
        for f in forward:
            h = f(h)
        loss = F.mse_loss(h, y.reshape(-1, W))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.04)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _refusals():
    import hf_zero
    from hf_zero.config.errors import ConfigError
    from hf_zero.pipe import PipelineModule
    from hf_zero.pipeline import PipelineError

    net = PipelineModule(layer_list(False), num_stages=2, loss_fn=F.mse_loss)
    out = {}
    try:
        hf_zero.initialize(model=net, config=ds_config(1, schedule="1f1b"))
    except ConfigError as exc:
        out["1f1b"] = str(exc)
    try:
        hf_zero.initialize(model=net, config=ds_config(2, use_reentrant="yes"))
    except ConfigError as exc:
        out["reentrant"] = str(exc)
    try:
        hf_zero.initialize(model=net, config=ds_config(2, bogus=1))
    except ConfigError as exc:
        out["unknown"] = str(exc)
    try:  # what accelerate's DeepSpeed plugin (or the Trainer) does with a pipeline config and a plain model
        hf_zero.initialize(model=torch.nn.Linear(2, 2), config=ds_config(2))
    except ConfigError as exc:
        out["plain_model"] = str(exc)
    engine, *_ = hf_zero.initialize(model=net, config=ds_config(2))
    for call in ("forward", "backward", "step"):
        try:
            getattr(engine, call)(torch.zeros(1))
        except PipelineError as exc:
            out[call] = str(exc)
    return out


def _refusals_then_shapes():
    """One process group for the refusals and both shape runs (a spawn costs more than the runs); the refused
    shape change comes last, since it marks the pipeline as failed."""
    return _refusals(), _shapes(True), _shapes(False)


def test_refusals_name_the_key_and_a_shape_change_is_refused_naming_dynamic_shape_or_works_with_it():
    results = run_distributed(_refusals_then_shapes, world_size=2, timeout_s=300)
    ref = _reference_dynamic()
    for out, worked, (kind, msg) in results:
        assert "gradient_accumulation_steps" in out["1f1b"] and "1 micro-batches" in out["1f1b"]
        assert "pipeline.use_reentrant" in out["reentrant"] and "true or false" in out["reentrant"]
        assert "pipeline.bogus" in out["unknown"]
        assert out["plain_model"].startswith("pipeline: ") and "hf_zero.pipeline.wrap" in out["plain_model"]
        for call in ("forward", "backward", "step"):
            assert out[call] == "Only train_batch() is accessible in pipeline mode."
        assert worked == pytest.approx(ref, rel=1e-5)  # dynamic_shape=True: trains through the change
        assert kind in ("PipelineError", "PipelineStageFailure"), (kind, msg)
        assert "dynamic_shape=True" in msg, msg
