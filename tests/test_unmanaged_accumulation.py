"""``managed_gradient_accumulation: false`` (DeepSpeed 0.19's unmanaged mode): the caller's ``engine.step()`` is the
accumulation boundary. Stages 0-3 on 1, 2 and 4 ranks match the single-process reference, with as many backward
passes per step as the caller likes; the calls that would move the boundary are refused by name."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.config.errors import ConfigError
from hf_zero.testing import run_distributed

from _parity import (CLIP, GAS, IN, LR, MICRO, OUT, STEPS, assert_matches_reference, base_config, clone_state,
                     engine_run, make_data, make_model, reference_run)

COUNTS = (1, 3, 2, 4)  # backward passes before each step(): fewer, more and as many as gradient_accumulation_steps


def _varying_data(world_size: int):
    g = torch.Generator().manual_seed(7)
    n = max(COUNTS)
    return (torch.randn(len(COUNTS), n, world_size, MICRO, IN, generator=g),
            torch.randn(len(COUNTS), n, world_size, MICRO, OUT, generator=g))


def _varying_reference(world_size: int):
    """One process, step s sees its COUNTS[s] micro-batches of every rank: the mean of the micro-batch losses."""
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    x, y = _varying_data(world_size)
    for s, n in enumerate(COUNTS):
        loss = nn.functional.mse_loss(model(x[s, :n].reshape(-1, IN)), y[s, :n].reshape(-1, OUT))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _unmanaged(stage: int, **extra) -> dict:
    config = base_config(stage, managed_gradient_accumulation=False, **extra)
    engine, *_ = hf_zero.initialize(model=make_model(), config=config)
    return engine


def _gas_run(engine, world: int, rank: int) -> list[float]:
    """The parity run: gradient_accumulation_steps backward passes (loss scaled by them), then one step()."""
    x, y = make_data(world)
    losses = []
    for s in range(STEPS):
        step_loss = torch.zeros(1)
        for m in range(GAS):
            loss = nn.functional.mse_loss(engine(x[s, m, rank]), y[s, m, rank])
            engine.backward(loss)
            step_loss += loss.detach() / GAS
        engine.step()
        if dist.is_initialized():
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
    return losses


def _varying_run(engine, world: int, rank: int) -> dict:
    """COUNTS[s] passes before step s, each loss divided by that count by the caller (scale_wrt_gas=False); one
    pass of each step is a direct loss.backward(). Records what the engine said about the boundary meanwhile."""
    x, y = _varying_data(world)
    seen_in_backward, applied, samples = [], [], []
    first = next(p for p in engine.module.parameters() if p.requires_grad)
    hook = first.register_hook(lambda g: seen_in_backward.append(engine.is_gradient_accumulation_boundary()) or g)
    for s, n in enumerate(COUNTS):
        for m in range(n):
            loss = nn.functional.mse_loss(engine(x[s, m, rank]), y[s, m, rank]) / n
            if m == n - 1:
                loss.backward()
            else:
                engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        applied.append(engine.was_step_applied())
        samples.append(engine.global_samples)
    hook.remove()
    return dict(seen_in_backward=seen_in_backward, applied=applied, samples=samples, steps=engine.global_steps,
                boundary_after=engine.is_gradient_accumulation_boundary())


def _train(cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage, extra in cases:
        engine = _unmanaged(stage, **extra)
        losses = _gas_run(engine, world, rank)
        out[(stage, "gas")] = (losses, clone_state(engine))
        engine.destroy()
        # gradient_accumulation_steps 1: the direct loss.backward() divides by it, as engine.backward does by
        # default (runtime/backward.py), so every pass of the varying run carries exactly the caller's 1/n
        engine = _unmanaged(stage, gradient_accumulation_steps=1, **extra)
        record = _varying_run(engine, world, rank)
        out[(stage, "varying")] = (record, clone_state(engine))
        engine.destroy()
    return out


CASES = ((0, {}), (1, {}), (2, {}), (3, {}))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_caller_owned_steps_match_the_reference(world_size):
    ref_losses, ref_params = reference_run(world_size)
    ref_varying = _varying_reference(world_size)
    results = run_distributed(_train, world_size, args=(CASES,))
    for stage, _ in CASES:
        what = f"stage {stage}, world {world_size}"
        losses, params = results[0][(stage, "gas")]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"{what}, gradient_accumulation_steps")
        for rank in range(world_size):
            record, params = results[rank][(stage, "varying")]
            if rank == 0 or stage != 3:  # stage 3's clone_state gathers to rank 0
                for name, ref in ref_varying.items():
                    torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{what}, varying counts, {name}: {m}")
            assert record["seen_in_backward"] == [False] * sum(COUNTS), what  # never a boundary inside backward
            assert record["applied"] == [True] * len(COUNTS) and record["steps"] == len(COUNTS), what
            assert not record["boundary_after"], what
            # DeepSpeed's count: micro-batch x data-parallel ranks per backward pass since the last step
            expected, total = [], 0
            for n in COUNTS:
                total += n * MICRO * world_size
                expected.append(total)
            assert record["samples"] == expected, what


def test_offload_and_overlap_comm_match_the_reference():
    """The optimizer on the host (stage 2 and 3) and stage 1 with overlap_comm (DeepSpeed refuses that pair;
    reducing at step() needs no overlap with backward, so hf_zero runs it)."""
    ref_losses, ref_params = reference_run(2)
    ref_varying = _varying_reference(2)
    offload = {"device": "cpu"}
    cases = ((2, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 200, "offload_optimizer": offload}}),
             (3, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40,
                                        "offload_optimizer": offload}}),
             (1, {"zero_optimization": {"stage": 1, "reduce_bucket_size": 200, "overlap_comm": True}}))
    results = run_distributed(_train, 2, args=(cases,))
    for stage, extra in cases:
        losses, params = results[0][(stage, "gas")]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"stage {stage} {extra}")
        record, params = results[0][(stage, "varying")]
        for name, ref in ref_varying.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6)
        assert record["applied"] == [True] * len(COUNTS)


def _misuse():
    engine = _unmanaged(1)
    errors = {}
    try:
        engine.set_gradient_accumulation_boundary(True)
    except AssertionError as err:  # DeepSpeed's type
        errors["boundary"] = str(err)
    try:
        with engine.coalesce_grad_reduction():
            pass
    except AssertionError as err:
        errors["coalesce"] = str(err)
    getter = engine.managed_gradient_accumulation()
    engine.destroy()
    return errors, getter


def test_boundary_setters_are_refused_naming_the_key():
    errors, getter = run_distributed(_misuse, 2)[0]
    assert getter is False
    assert errors["boundary"].startswith("managed_gradient_accumulation: false, and "
                                         "set_gradient_accumulation_boundary() was called")
    assert errors["coalesce"].startswith("managed_gradient_accumulation: false, and coalesce_grad_reduction() was "
                                         "entered")


def test_config_refuses_it_with_zenflow_and_documents_the_key():
    from hf_zero.config import load_config

    config = base_config(2, managed_gradient_accumulation=False)
    config["zero_optimization"]["zenflow"] = {"topk_ratio": 0.1, "update_interval": 4}
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    with pytest.raises(ConfigError, match="managed_gradient_accumulation: false is not supported with "
                                          "zero_optimization.zenflow"):
        load_config(config, world_size=1)
    assert load_config(base_config(0), world_size=1).managed_gradient_accumulation is True


def _pipeline_refuses():
    from hf_zero.pipe import LayerSpec, PipelineModule

    module = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)], num_stages=2,
                            loss_fn=nn.functional.mse_loss)
    # one micro-batch for two stages: the schedule would refuse it too, but this key is the error (DeepSpeed's order)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "managed_gradient_accumulation": False, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    try:
        hf_zero.initialize(model=module, config=config)
    except AssertionError as err:  # DeepSpeed's type; a ConfigError too
        return str(err) if isinstance(err, ConfigError) else None
    return None


def test_pipeline_engine_refuses_it():
    message = run_distributed(_pipeline_refuses, 2)[0]
    assert message is not None and message.startswith("managed_gradient_accumulation: false is not supported with "
                                                       "pipeline parallelism")


def _allreduce_midway(stages):
    """The parity run with engine.allreduce_gradients() after every backward (DeepSpeed's public call): at stages
    0/1 the first micro-batch's gradients are reduced early, the boundary adds the second's."""
    from hf_zero.zero.tensor_fragment import safe_get_full_grad

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(stage))
        midway = []

        def reduce_now(s, m):
            engine.allreduce_gradients()
            if s == 0 and m == 0:  # reduced now: the same on every rank (this rank's own before the call)
                first = safe_get_full_grad(next(p for p in engine.module.parameters() if p.requires_grad))
                midway.append(first.clone() if first is not None else None)

        losses = engine_run(engine, world, rank, after_backward=reduce_now)
        name = "no_sync" if stage < 2 else "coalesce_grad_reduction"  # stages 2-3 refuse no_sync itself
        with pytest.raises(AssertionError, match=rf"allreduce_gradients\(\) inside engine.{name}\(\)"):
            with getattr(engine, name)():
                engine.allreduce_gradients()
        with pytest.warns(UserWarning, match=r"allreduce_gradients\(bucket_size=1000\) has no effect"):
            engine.allreduce_gradients(bucket_size=1000)
        out[stage] = (losses, clone_state(engine), midway[0])
        engine.destroy()
    return out


def test_allreduce_gradients_between_boundaries_keeps_the_reference():
    ref_losses, ref_params = reference_run(2)
    results = run_distributed(_allreduce_midway, 2, args=((0, 1, 2, 3),))
    for stage in (0, 1, 2, 3):
        losses, params, midway = results[0][stage]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"stage {stage} with allreduce_gradients")
        if stage < 2:  # the first micro-batch's gradient was reduced by the call: equal on both ranks
            assert midway is not None and torch.equal(midway, results[1][stage][2]), stage
