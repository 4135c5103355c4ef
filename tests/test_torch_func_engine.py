"""torch.func transforms over ``engine(...)`` (per-sample gradients, Jacobians): at stages 0-2 they see the model's
own derivatives -- no accumulation-steps division, no reduction -- as DeepSpeed's engine gives them; at ZeRO-3, where
parameter storages are swapped around each forward, they are refused by name instead of crashing torch."""

import copy

import pytest
import torch
from torch import nn

import hf_zero


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()


def _engine(stage: int):
    torch.manual_seed(0)
    model = _Tiny()
    baseline = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    return engine, baseline


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_transforms_see_the_models_own_derivatives(stage):
    engine, baseline = _engine(stage)
    x, xs = torch.randn(8), torch.randn(3, 8)
    grad = torch.func.grad(lambda v: engine(v))(x)
    torch.testing.assert_close(grad, torch.func.grad(lambda v: baseline(v))(x), rtol=0, atol=1e-6)
    per_sample = torch.func.vmap(torch.func.grad(lambda v: engine(v)))(xs)
    torch.testing.assert_close(per_sample, torch.func.vmap(torch.func.grad(lambda v: baseline(v)))(xs),
                               rtol=0, atol=1e-6)
    jac = torch.func.jacrev(lambda v: engine.module.fc1(v))(x)
    torch.testing.assert_close(jac, engine.module.fc1.weight.detach(), rtol=0, atol=0)
    # the training backward afterwards still divides by the accumulation steps and steps
    before = baseline.fc2.weight.detach().clone()
    for _ in range(4):
        engine.backward(engine(x.unsqueeze(0)))
        engine.step()
    moved = (engine.module.fc2.weight.detach() - before).abs().max().item()
    assert engine.global_steps == 1 and 0 < moved <= 1.01e-3  # one Adam step of lr 1e-3
    engine.destroy()


def test_zero3_refuses_a_transform_over_its_first_forward():
    engine, _ = _engine(3)
    with pytest.raises(RuntimeError, match=r"torch\.func transform .* ZeRO-3 engine"):
        torch.func.grad(lambda v: engine(v))(torch.randn(8))
    engine.destroy()
