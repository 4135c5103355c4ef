"""``engine.coalesce_grad_reduction()`` (DeepSpeed's): several backward passes inside one block, one reduction when it
ends. Stages 0-3 on 1, 2 and 4 ranks match the single-process reference, with fewer reductions where the stage
would otherwise reduce every micro-step (2 and 3); misuse is refused by name."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.testing import run_distributed

from _parity import (GAS, STEPS, assert_matches_reference, base_config, clone_state, make_data, make_model,
                     reference_run)


def _count_reductions(monkeypatch_targets: list) -> list[int]:
    """Wrap the reducers' collectives with a counter (this process only); returns the one-element counter."""
    import hf_zero.zero.grad_reducer as stage012
    import hf_zero.zero.stage3.reduce as stage3

    count = [0]
    for module, name in ((stage012, "reduce_scatter_filled"), (stage012, "all_reduce_"),
                         (stage3, "reduce_scatter_filled")):
        original = getattr(module, name)

        def counted(*args, _original=original, **kwargs):
            count[0] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counted)
        monkeypatch_targets.append((module, name, original))
    return count


def _coalesced_run(engine, world_size: int, rank: int) -> list[float]:
    """The parity run with each step's GAS backward passes inside one block and one step() after it."""
    x, y = make_data(world_size)
    losses = []
    for s in range(STEPS):
        step_loss = torch.zeros(1)
        with engine.coalesce_grad_reduction():
            for m in range(GAS):
                loss = nn.functional.mse_loss(engine(x[s, m, rank]), y[s, m, rank])
                engine.set_gradient_accumulation_boundary(m == GAS - 1)
                engine.backward(loss)
                step_loss += loss.detach() / GAS
        engine.step()
        if dist.is_initialized():
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world_size)
    return losses


def _separate_run(engine, world_size: int, rank: int) -> None:
    """The same steps without the block: every backward reduces as the stage decides."""
    x, y = make_data(world_size)
    for s in range(STEPS):
        for m in range(GAS):
            engine.backward(nn.functional.mse_loss(engine(x[s, m, rank]), y[s, m, rank]))
            engine.step()


def _train(stages):
    rank, world = dist.get_rank(), dist.get_world_size()
    patched: list = []
    count = _count_reductions(patched)
    out = {}
    try:
        for stage in stages:
            count[0] = 0
            engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(stage))
            losses = _coalesced_run(engine, world, rank)
            coalesced = count[0]
            params = clone_state(engine)
            engine.destroy()
            count[0] = 0
            engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(stage))
            _separate_run(engine, world, rank)
            out[stage] = (losses, params, coalesced, count[0])
            engine.destroy()
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_coalesced_steps_match_the_reference_with_fewer_reductions(world_size):
    ref_losses, ref_params = reference_run(world_size)
    results = run_distributed(_train, world_size, args=((0, 1, 2, 3),))
    for stage in (0, 1, 2, 3):
        losses, params, coalesced, separate = results[0][stage]
        assert_matches_reference(losses, params, ref_losses, ref_params, f"stage {stage}, world {world_size}")
        if world_size == 1:
            assert coalesced == 0 and separate == 0, (stage, coalesced, separate)  # alone: nothing to reduce
        elif stage == 2:  # fixed buckets: one pass per step instead of one per micro-step
            assert coalesced * GAS == separate > 0, (coalesced, separate)
        elif stage == 3:  # buckets fill in arrival order (the block: ds_id order), so only fewer is exact
            assert 0 < coalesced < separate, (coalesced, separate)
        else:  # stages 0/1 reduce once per step (at the boundary) either way
            assert coalesced == separate > 0, (stage, coalesced, separate)


def _misuse(stage):
    config = base_config(stage, gradient_accumulation_steps=1)
    engine, *_ = hf_zero.initialize(model=make_model(), config=config)
    x, y = make_data(1)
    errors = {}
    with engine.coalesce_grad_reduction():
        engine.backward(nn.functional.mse_loss(engine(x[0, 0, 0]), y[0, 0, 0]))
        for name, call in (("step", engine.step), ("nested", lambda: engine.coalesce_grad_reduction().__enter__()),
                           ("no_sync", lambda: engine.no_sync().__enter__())):
            try:
                call()
            except RuntimeError as err:
                errors[name] = str(err)
                errors[f"{name}_is_assertion"] = isinstance(err, AssertionError)  # DeepSpeed asserts there
    engine.step()  # after the block: applies the held gradients
    applied = engine.was_step_applied()
    # a block that raises reduces nothing and drops what it held: the next step starts from zero gradients
    with pytest.raises(ValueError, match="user error"):
        with engine.coalesce_grad_reduction():
            engine.backward(nn.functional.mse_loss(engine(x[0, 1, 0]), y[0, 1, 0]) * 1e6)
            raise ValueError("user error")
    before = clone_state(engine)
    with engine.coalesce_grad_reduction():
        engine.backward(nn.functional.mse_loss(engine(x[1, 0, 0]), y[1, 0, 0]))
    engine.step()
    after = clone_state(engine)
    engine.destroy()
    return errors, applied, {n: (after[n] - before[n]).abs().max().item() for n in before}


@pytest.mark.parametrize("stage", [1, 3])
def test_misuse_is_refused_and_a_raising_block_drops_its_gradients(stage):
    errors, applied, moved = run_distributed(_misuse, 2, args=(stage,))[0]
    assert "step() inside engine.coalesce_grad_reduction()" in errors["step"]
    assert "nested" in errors["nested"] and "no_sync() inside" in errors["no_sync"]
    assert errors["step_is_assertion"] and errors["nested_is_assertion"] and errors["no_sync_is_assertion"]
    assert applied
    # the 1e6-scaled gradient was dropped: Adam's update per element is at most ~lr (1e-2) for one normal step
    assert 0 < max(moved.values()) < 2e-2, moved


def test_pipeline_engine_refuses_it():
    """Decided by DeepSpeed's engine attribute ``pipeline_parallelism`` (True on the pipeline engine only)."""
    from hf_zero.runtime.engine import HfZeroEngine
    from hf_zero.runtime.pipe_engine import PipelineEngine

    assert PipelineEngine.pipeline_parallelism is True and HfZeroEngine.pipeline_parallelism is False
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        with PipelineEngine.coalesce_grad_reduction(object.__new__(PipelineEngine)):
            pass

