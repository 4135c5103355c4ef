"""Per-rank bytes: optimizer state is 1/N of the full state; stage-2 gradients are 1/N right after backward."""

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.testing import run_distributed

from _parity import GAS, MICRO, IN, base_config, make_model

WORLD = 4


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(stage):
    model = make_model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_trainable_tensors = sum(1 for p in model.parameters() if p.requires_grad)
    engine, *_ = hf_zero.initialize(model=model, config=base_config(stage))
    x = torch.randn(MICRO, IN)
    engine.backward(engine(x).square().mean())  # micro-step 1 of GAS=2: not a boundary
    after_first_backward = _tensor_bytes(p.grad for p in engine.module.parameters() if p.grad is not None)
    shard_grad_bytes = _tensor_bytes(g.grad for g in engine.groups)
    engine.step()
    engine.backward(engine(x).square().mean())
    engine.step()  # boundary: the optimizer has state now
    state = [t for g in engine.groups for t in engine.optimizer.state[g.master].values()
             if torch.is_tensor(t) and t.numel() > 1]
    return dict(trainable=trainable, n_tensors=n_trainable_tensors, shard_numel=sum(g.shard_numel for g in engine.groups),
                state_bytes=_tensor_bytes(state) + _tensor_bytes(g.master for g in engine.groups),
                full_grad_bytes_after_backward=after_first_backward, shard_grad_bytes=shard_grad_bytes,
                frozen_grads=[p.grad is not None for p in engine.module.parameters() if not p.requires_grad])


def _all_stages():
    return {stage: _measure(stage) for stage in (1, 2)}


def test_optimizer_state_and_stage2_gradients_are_one_nth_per_rank():
    results = run_distributed(_all_stages, WORLD)
    for rank, by_stage in enumerate(results):
        for stage, m in by_stage.items():
            # fp32 master + exp_avg + exp_avg_sq = 12 bytes per element of this rank's shard, and the shard is 1/N
            # of the trainable elements plus at most one element of padding per tensor
            assert m["state_bytes"] == 12 * m["shard_numel"]
            assert m["trainable"] / WORLD <= m["shard_numel"] <= m["trainable"] / WORLD + m["n_tensors"]
            assert m["frozen_grads"] == [False, False], "frozen layer got gradients"
        # stage 1 keeps the full gradient between micro-steps; stage 2 reduced and freed it during backward
        assert by_stage[1]["full_grad_bytes_after_backward"] == 4 * by_stage[1]["trainable"]
        assert by_stage[2]["full_grad_bytes_after_backward"] == 0
        # the gradient shard: from the window's first backward at stage 2 (reduced every micro-step), only at the
        # boundary at stage 1
        assert by_stage[2]["shard_grad_bytes"] == 4 * by_stage[2]["shard_numel"]
        assert by_stage[1]["shard_grad_bytes"] == 0
