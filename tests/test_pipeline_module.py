"""DeepSpeed-style PipelineModule + hf_zero.initialize -> train_batch, against one process training the same layers.

SGD with gradient_clipping 1.0 (the clip is active every step), so a norm taken over one stage only -- DeepSpeed's
ZeRO-0 pipeline bug -- would change every update. Tied and untied; 2 stages (1F1B, GPipe, interleaved with 2
virtual stages, looped BFS, interleaved zero-bubble), 4 stages, and 2 stages x 2 replicas at ZeRO 0-3.
"""

from __future__ import annotations

import pytest
import torch

from hf_zero.testing import run_distributed

from _pipe_util import CLIP, data, ds_config, layer_list, reference_run

STEPS = 3


def _train(cases):
    import torch.distributed as dist

    import hf_zero
    from hf_zero.pipe import PipelineModule

    out = {}
    for case in cases:
        name, stages, tied, micro_batches, zero, schedule, virtual, partition = case
        world = dist.get_world_size()
        net = PipelineModule(layer_list(tied), num_stages=stages, loss_fn=torch.nn.functional.mse_loss,
                             seed_layers=True, partition_method=partition, virtual_stages=virtual)
        engine, *_ = hf_zero.initialize(model=net, config=ds_config(micro_batches, zero, schedule,
                                                                     virtual_stages=virtual))
        dp, d = engine.grid.data_parallel_size, engine.grid.data_parallel_id
        assert world == stages * dp
        x, y = data(STEPS, micro_batches, dp)
        losses, norms = [], []
        for s in range(STEPS):
            it = iter([(x[s, j, d], y[s, j, d]) for j in range(micro_batches)])
            losses.append(engine.train_batch(it).item())
            norms.append(engine.get_global_grad_norm())
        eval_loss = engine.eval_batch(iter([(x[0, j, d], y[0, j, d]) for j in range(micro_batches)])).item()
        if engine.stage3 is not None:
            from hf_zero.zero import GatheredParameters

            with GatheredParameters(list(net.parameters())):
                state = {f"{i}.{k}": v.clone() for i, sd in net.layer_state_dicts().items() for k, v in sd.items()}
        else:
            state = {f"{i}.{k}": v.clone() for i, sd in net.layer_state_dicts().items() for k, v in sd.items()}
        out[name] = dict(losses=losses, norms=norms, state=state, eval_loss=eval_loss, first=engine.is_first_stage(),
                         last=engine.is_last_stage(), parts=net.parts)
        engine.destroy()
    return out


def _seeding():
    """seed_layers=True: layer i of the k-th forward draws from seed base * (k + 1) + i (DeepSpeed's), so micro-batches
    get different dropout masks, and a checkpointed range recomputes its forward's mask."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from hf_zero.pipe import LayerSpec, PipelineModule

    world, rank, base = dist.get_world_size(), dist.get_rank(), 1234
    net = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Dropout, 0.5)] * world, num_stages=world,
                         seed_layers=True, base_seed=base, partition_method="uniform")
    linear = net.forward_funcs[2 * rank]
    x = torch.ones(8, 4)

    def expected(k):
        torch.manual_seed(base * (k + 1) + 2 * rank + 1)
        return F.dropout(linear(x), 0.5)

    first, second = net(x), net(x)
    net.activation_checkpoint_interval = 2
    third = net(x)
    third.sum().backward()
    grad = linear.weight.grad.clone()
    linear.weight.grad = None
    expected(3).sum().backward()
    return dict(differ=bool((first != second).any()), first=torch.equal(first, expected(1)),
                second=torch.equal(second, expected(2)), third=torch.equal(third, expected(3)),
                grad=torch.equal(grad, linear.weight.grad))


def _train_and_seed(cases):
    out = _train(cases)
    out["_seeding"] = _seeding()
    return out


def _check(results, case):
    name, stages, tied, micro_batches = case[:4]
    dp = len(results) // stages
    ref_losses, ref_norms, ref_state, ref_eval = reference_run(tied, STEPS, micro_batches, dp)
    assert all(n > CLIP for n in ref_norms), ref_norms  # the clip is active
    merged = {}
    for rank, per_case in enumerate(results):
        r = per_case[name]
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), (name, rank)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), (name, rank)
        assert r["eval_loss"] == pytest.approx(ref_eval, rel=1e-5), (name, rank)
        merged.update(r["state"])
    assert sorted(merged) == sorted(ref_state), name
    for key, ref in ref_state.items():
        torch.testing.assert_close(merged[key], ref, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


CASES_2 = [
    # name, stages, tied, micro-batches, zero stage, schedule, virtual stages, partition
    ("1f1b-untied", 2, False, 2, 0, "1f1b", 1, "parameters"),
    ("1f1b-tied", 2, True, 3, 0, "1f1b", 1, "uniform"),
    ("gpipe-tied", 2, True, 1, 1, "gpipe", 1, "type:linear"),
    ("interleaved-tied", 2, True, 4, 0, "interleaved_1f1b", 2, "uniform"),
    ("looped-bfs-tied", 2, True, 4, 0, "looped_bfs", 2, "uniform"),
    ("zero-bubble-tied", 2, True, 4, 1, "interleaved_zero_bubble", 2, "uniform"),
]
CASES_4 = [
    ("pp4-tied", 4, True, 4, 0, "1f1b", 1, "parameters"),
    ("pp2dp2-z0-tied", 2, True, 2, 0, "1f1b", 1, "parameters"),
    ("pp2dp2-z1-untied", 2, False, 2, 1, "1f1b", 1, "parameters"),
    ("pp2dp2-z2-tied", 2, True, 2, 2, "gpipe", 1, "parameters"),
    ("pp2dp2-z3-tied", 2, True, 2, 3, "1f1b", 1, "parameters"),
]


def test_pipeline_module_two_stages_matches_one_process():
    results = run_distributed(_train_and_seed, world_size=2, args=(CASES_2,), timeout_s=400)
    for case in CASES_2:
        _check(results, case)
    for r in results:
        assert r["_seeding"] == dict(differ=True, first=True, second=True, third=True, grad=True), r["_seeding"]
    # the first and last stage know they are
    assert [r["1f1b-untied"]["first"] for r in results] == [True, False]
    assert [r["1f1b-untied"]["last"] for r in results] == [False, True]


def test_pipeline_module_four_ranks_matches_one_process():
    results = run_distributed(_train, world_size=4, args=(CASES_4,), timeout_s=500)
    for case in CASES_4:
        _check(results, case)


class _CachedWeight(torch.nn.Module):
    """A layer whose constructor caches its weight at class level (as layers that load or share weights do)."""

    cache: dict = {}

    def __init__(self):
        super().__init__()
        if "w" not in _CachedWeight.cache:
            _CachedWeight.cache["w"] = torch.full((4, 4), 0.5)
        self.weight = torch.nn.Parameter(_CachedWeight.cache["w"].clone())

    def forward(self, x):
        return x @ self.weight


def _parameter_counting():
    import torch.distributed as dist
    from torch import nn

    from hf_zero.pipe import LayerSpec, PipelineModule

    world = dist.get_world_size()
    _CachedWeight.cache.clear()
    net = PipelineModule([LayerSpec(_CachedWeight), LayerSpec(nn.Linear, 4, 4)] * world, num_stages=world,
                         partition_method="parameters")
    cached = net.forward_funcs[2 * dist.get_rank()]
    weights = {}
    for method in ("parameters", "uniform"):  # counting builds each spec once: the draws of the real build stay
        torch.manual_seed(7)
        built = PipelineModule([LayerSpec(nn.Linear, 4, 4)] * (2 * world), num_stages=world, partition_method=method)
        weights[method] = [p.detach().clone() for p in built.parameters()]
    return dict(device=str(cached.weight.device), value=cached.weight.detach().tolist(), parts=net.parts,
                same=all(torch.equal(a, b) for a, b in zip(weights["parameters"], weights["uniform"])))


def test_parameter_counting_builds_specs_on_the_cpu_without_moving_the_rng():
    """partition_method="parameters" counts by building each LayerSpec on the CPU (DeepSpeed's way): a constructor
    that caches a weight keeps a real tensor for the real build (on the meta device it kept a meta one).

    DeepSpeed 0.19.8's run of the same worker (scripts/ds_pattern_workers.py::layerspec_counting, 2 CPU ranks; its
    forward_funcs holds only the stage's own layers): the cached layer's weight is on cpu, all 0.5, parts [0, 2, 4]
    -- as here. One difference, kept on purpose: DeepSpeed's counting build draws from the global RNG, so the same
    seed gives different weights under partition_method="parameters" than under "uniform" (its ``same`` is False);
    hf_zero restores the RNG state after counting, so the weights do not depend on how the layers were cut."""
    for out in run_distributed(_parameter_counting, 2, timeout_s=120):
        assert out["device"] == "cpu" and out["value"] == [[0.5] * 4] * 4
        assert out["parts"] == [0, 2, 4] and out["same"]


def test_pipeline_engine_answers_deepspeeds_data_and_rank_setters():
    """DeepSpeed's PipelineEngine.set_dataloader / get_pipeline_parallel_rank / set_has_attention_mask."""
    from hf_zero.runtime.pipe_engine import PipelineEngine

    engine = object.__new__(PipelineEngine)  # the setters touch no process group
    engine.stage_id = 1
    engine.set_dataloader([("x0", "y0"), ("x1", "y1")])
    assert next(engine.data_iterator) == ("x0", "y0") and engine.training_dataloader == [("x0", "y0"), ("x1", "y1")]
    assert engine.get_pipeline_parallel_rank() == 1
    engine.set_has_attention_mask(True)
    assert engine.has_attention_mask is True
    with pytest.raises(TypeError, match="expected a bool"):
        engine.set_has_attention_mask(1)
