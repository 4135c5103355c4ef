"""Activation checkpointing inside pipeline stages, as DeepSpeed scripts choose it, and ``eval_batch`` with the
non-tensor labels DeepSpeed's own tests feed.

* ``pipeline.use_reentrant``: ``false`` swaps in ``non_reentrant_checkpoint`` (DeepSpeed's rule), ``true`` keeps the
  module's function -- DeepSpeed's reentrant ``checkpointing.checkpoint`` when none was given. That function (also
  when a script passes it as ``activation_checkpoint_func``, the Megatron-DeepSpeed habit) runs as its
  non-reentrant twin in a stage; ``true`` with the zero-bubble schedule is refused naming both keys.
* a function of the script's own gets the first stage's inputs marked as requiring grad, as DeepSpeed does:
  otherwise a reentrant one cuts the first region's parameters off from their gradients, silently.

Every variant trains on 2 stages like one process (tests/_pipe_util.py's reference)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_zero.testing import run_distributed

from _pipe_util import data, ds_config, layer_list, reference_run

STEPS = 3


def _variants():
    from hf_zero.runtime.activation_checkpointing import checkpoint, non_reentrant_checkpoint

    torch_non_reentrant = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    return {  # name: (PipelineModule kwargs, pipeline config, the function the module ends with)
        "deepspeed_reentrant_func": ({"activation_checkpoint_func": checkpoint}, {}, checkpoint),
        "use_reentrant_true": ({}, {"use_reentrant": True}, checkpoint),
        "use_reentrant_false": ({"activation_checkpoint_func": checkpoint}, {"use_reentrant": False},
                                non_reentrant_checkpoint),
        "own_func": ({"activation_checkpoint_func": torch_non_reentrant}, {}, torch_non_reentrant),
    }


def _worker():
    import hf_zero
    from hf_zero.config.errors import ConfigError
    from hf_zero.pipe import PipelineModule

    out = {}
    x, y = data(STEPS, 2, 1)
    for name, (kwargs, pipeline, func) in _variants().items():
        net = PipelineModule(layer_list(False), num_stages=2, loss_fn=F.mse_loss, seed_layers=True,
                             activation_checkpoint_interval=1, **kwargs)
        engine, *_ = hf_zero.initialize(model=net, config=ds_config(2, **pipeline))
        losses = [engine.train_batch(iter([(x[s, j, 0], y[s, j, 0]) for j in range(2)])).item()
                  for s in range(STEPS)]
        out[name] = (losses, net.activation_checkpoint_func is func or net.activation_checkpoint_func == func)
        engine.destroy()
    try:
        hf_zero.initialize(model=PipelineModule(layer_list(False), num_stages=2, loss_fn=F.mse_loss),
                           config=ds_config(2, schedule="interleaved_zero_bubble", use_reentrant=True))
    except ConfigError as exc:
        out["zero_bubble"] = str(exc)
    out["eval"] = _eval_with_int_labels()
    out["first_region_grads"] = _first_region_grads()
    return out


def _first_region_grads():
    """The first stage's own forward and backward with torch's *reentrant* checkpoint (the script's function): its
    first region's weight gets the gradient it gets without checkpointing."""
    from hf_zero.pipe import PipelineModule

    x = torch.randn(4, 6)
    grads = []
    for func in (None, functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)):
        net = PipelineModule(layer_list(False), num_stages=2, seed_layers=True, activation_checkpoint_interval=1,
                             activation_checkpoint_func=func)
        net(x).square().sum().backward()
        first = net.forward_funcs.get(0)  # layer 0 lives on the first stage only
        grads.append(None if first is None or first.weight.grad is None else first.weight.grad.clone())
    net.set_checkpoint_interval(0)  # DeepSpeed's setter: checkpointing off from the next forward
    interval = net.activation_checkpoint_interval
    try:
        net.set_checkpoint_interval(-1)
    except ValueError as exc:
        refused = str(exc)
    return grads, interval, refused


def _eval_with_int_labels():
    """DeepSpeed's test_pipe_module: a Sequential without loss_fn, labels ``0``, eval_batch == the module's output."""
    import hf_zero
    from hf_zero.pipe import PipelineModule

    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 1))
    x = torch.randn(1, 8)
    expected = copy.deepcopy(seq)(x).detach()
    pipe = PipelineModule(layers=copy.deepcopy(seq), num_stages=2)
    engine, *_ = hf_zero.initialize(model=pipe, model_parameters=[p for p in pipe.parameters()], config={
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "pipeline": {"activation_checkpoint_interval": 1}})
    got = engine.eval_batch(data_iter=iter([(x.clone(), 0)] * 2))
    engine.destroy()
    return expected, got


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout_s=300)


@pytest.mark.parametrize("name", list(_variants()))
def test_each_checkpoint_function_trains_like_one_process(results, name):
    ref_losses = reference_run(False, STEPS, 2, 1)[0]
    for out in results:
        losses, func_as_deepspeed_sets_it = out[name]
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert func_as_deepspeed_sets_it


def test_use_reentrant_true_with_the_zero_bubble_schedule_is_refused_naming_both_keys(results):
    for out in results:
        assert "pipeline.use_reentrant" in out["zero_bubble"] and "interleaved_zero_bubble" in out["zero_bubble"]


def test_a_reentrant_function_of_the_scripts_own_still_reaches_the_first_regions_parameters(results):
    (plain, reentrant), interval, refused = results[0]["first_region_grads"]  # rank 0 holds the first stage
    assert interval == 0 and "set_checkpoint_interval(-1)" in refused
    assert reentrant is not None
    torch.testing.assert_close(reentrant, plain, rtol=1e-6, atol=0)


def test_eval_batch_with_integer_labels_gives_the_modules_output(results):
    for out in results:
        expected, got = out["eval"]
        torch.testing.assert_close(got.reshape(-1), expected.reshape(-1), rtol=1e-5, atol=1e-6)
