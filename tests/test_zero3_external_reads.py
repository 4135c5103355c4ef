"""ZeRO-3 and parameters used without calling their module: ``nn.MultiheadAttention`` reading ``out_proj.weight``
is gathered automatically; a module using ``parameters()`` of its children needs ``set_z3_leaf_modules`` and, without
it, the error names the module and the fix. Every case trains to the same losses as stage 0 on 2 ranks."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.testing import run_distributed

STEPS = 3


class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.mha(h, h, h, need_weights=False)
        return self.out(a).mean(1)


class StackedExperts(nn.Module):
    """Uses its experts' weights through ``parameters()``: invisible to attribute-read detection."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(6, 6, bias=False) for _ in range(3))

    def forward(self, x):
        w = torch.stack(list(self.experts.parameters())).sum(0)
        return x @ w.t()


class ExpertNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = StackedExperts()
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.moe(x)).mean(1)


class HeadReadNet(nn.Module):
    """The root has no parameters of its own and reads its head's weights without calling the head: the read makes
    them the root's external parameters, so from the next iteration the root has a group where it only tracked its
    forward before -- decided inside the root's own pre-forward hooks (TRL's GRPO hit this after generation)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return nn.functional.linear(torch.relu(self.body(x)), self.head.weight, self.head.bias).mean(1)


def _config(stage):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "steps_per_print": 1000, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10}}


def _train(model_cls, stage, leaf=None):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = model_cls()
    if leaf is not None:
        import deepspeed  # hf_zero's compatibility layer answers this name

        marked = deepspeed.utils.set_z3_leaf_modules(model, [leaf])
        assert [type(m).__name__ for m in marked] == ["StackedExperts"]
    engine, *_ = hf_zero.initialize(model=model, config=_config(stage))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(2, 2, 5, 6, generator=g), torch.randn(2, 2, 3, generator=g)
        loss = nn.functional.mse_loss(engine(x[rank]), y[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def _attention_both_stages():
    return (_train(AttnNet, 0), _train(AttnNet, 3)), (_train(HeadReadNet, 0), _train(HeadReadNet, 3))


def test_multihead_attention_trains_at_zero3_like_stage0():
    for cases in run_distributed(_attention_both_stages, 2):
        for stage0, stage3 in cases:  # AttnNet, HeadReadNet
            assert len(stage3) == STEPS
            torch.testing.assert_close(torch.tensor(stage3), torch.tensor(stage0), rtol=1e-5, atol=0)


def _experts_cases():
    out = {"stage0": _train(ExpertNet, 0), "leaf_by_name": _train(ExpertNet, 3, leaf="StackedExperts")}
    try:
        _train(ExpertNet, 3)
    except RuntimeError as e:
        out["error"] = "\n".join([str(e), *getattr(e, "__notes__", [])])
    return out


def test_unseen_parameter_use_names_the_module_and_leaf_modules_fix_it():
    for r in run_distributed(_experts_cases, 2):
        torch.testing.assert_close(torch.tensor(r["leaf_by_name"]), torch.tensor(r["stage0"]), rtol=1e-5, atol=0)
        assert "'moe' (StackedExperts)" in r["error"]
        assert "set_z3_leaf_modules(model, [StackedExperts])" in r["error"]


def test_set_z3_leaf_modules_matches_deepspeed_semantics():
    from hf_zero.zero import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

    model = ExpertNet()
    full_name = f"{StackedExperts.__module__}.{StackedExperts.__qualname__}"
    assert set_z3_leaf_modules(model, [full_name]) == [model.moe]
    assert z3_leaf_module(model.moe) and get_z3_leaf_modules(model) == [model.moe]
    assert unset_z3_leaf_modules(model, [StackedExperts]) == [model.moe] and not get_z3_leaf_modules(model)
    with pytest.raises(ValueError, match="MixtralSparseMoeBlock"):
        set_z3_leaf_modules(model, ["MixtralSparseMoeBlock"])
    assert set_z3_leaf_modules(model, ["MixtralSparseMoeBlock"], raise_if_not_found=False) == []
