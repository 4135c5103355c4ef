"""A scheduler the script built on its own optimizer before ``initialize`` sets the learning rate that is trained
with, as in DeepSpeed: ``initialize(model, optimizer=opt, lr_scheduler=sched)`` -- also what accelerate's
``prepare(model, optimizer, scheduler)`` calls. DeepSpeed's ZeRO optimizer steps the client's optimizer with its
groups' parameters swapped for the shards, so the client's ``param_groups`` are the trained ones; hf_zero's engine
optimizer takes those groups over (runtime/optimizers.adopt_client_groups).

Before the fix the scheduler stepped the client's groups, which nothing trained with: with
``get_linear_schedule_with_warmup`` (lr 0 at step 0) the model never moved. Probed against DeepSpeed 0.19.8
(``DS_ACCELERATOR=cpu``, a 4-parameter Linear, AdamW lr 0.1, ZeRO 0): LambdaLR 1/(s+1) trains at
0.05, 0.0333, 0.025, 0.02; the linear warmup (2 of 6 steps) at 0.05, 0.1, 0.075, 0.05 -- hf_zero now the same.
"""

from __future__ import annotations

import pytest
import torch

import hf_zero

STEPS, LR = 5, 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]


def _scheduler(kind: str, opt):
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    if kind == "warmup":
        from transformers import get_linear_schedule_with_warmup

        return get_linear_schedule_with_warmup(opt, 2, 6)
    # OneCycleLR keeps initial_lr / max_lr / min_lr in the groups and reads them back every step
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS + 1)


def _optimizer(model, two_groups: bool):
    if two_groups:  # per-group learning rates: each group's schedule must reach its own shards
        first, second = list(model[0].parameters()), list(model[2].parameters())
        return torch.optim.AdamW([{"params": first}, {"params": second, "lr": LR / 4}], lr=LR, weight_decay=0.01)
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _reference(kind: str, two_groups: bool):
    model = _model()
    opt = _optimizer(model, two_groups)
    sched = _scheduler(kind, opt)
    losses, lrs = [], []
    for x, y in _data():
        lrs.append([g["lr"] for g in opt.param_groups])
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, lrs


def _engine(stage: int, kind: str, two_groups: bool):
    model = _model()
    opt = _optimizer(model, two_groups)
    sched = _scheduler(kind, opt)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage}}
    engine, _, _, engine_sched = hf_zero.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    assert engine_sched is sched
    return engine, opt, sched


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind, two_groups", [("lambda", False), ("warmup", True), ("onecycle", False)])
def test_the_clients_scheduler_sets_the_trained_learning_rate(stage, kind, two_groups):
    ref_losses, ref_lrs = _reference(kind, two_groups)
    engine, opt, sched = _engine(stage, kind, two_groups)
    losses, lrs = [], []
    for x, y in _data():
        lrs.append(engine.get_lr())
        assert [g["lr"] for g in opt.param_groups] == lrs[-1]  # the script's optimizer reads what is trained
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert sum(lrs, []) == pytest.approx(sum(ref_lrs, []), rel=1e-12)
    if kind == "warmup":
        assert lrs[0] == [0.0, 0.0]  # the warmup's first step trains nothing; the later ones must move the model
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert sched.last_epoch == STEPS


def test_a_resumed_run_continues_the_clients_schedule(tmp_path):
    engine, opt, sched = _engine(2, "warmup", False)
    data = _data()
    for x, y in data[:2]:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    expected = []
    for x, y in data[2:]:
        expected.append(engine.get_lr())
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    resumed, opt2, sched2 = _engine(2, "warmup", False)  # a fresh script: new optimizer and scheduler
    resumed.load_checkpoint(str(tmp_path))
    got = []
    for x, y in data[2:]:
        got.append(resumed.get_lr())
        assert [g["lr"] for g in opt2.param_groups] == got[-1]
        resumed.backward(torch.nn.functional.mse_loss(resumed(x), y))
        resumed.step()
    assert got == expected and got[0] == [pytest.approx(0.1)]  # warmup done: lr 0.1 at step 2 of 6, then down
