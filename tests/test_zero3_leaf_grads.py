"""ZeRO-3 leaf modules whose ranks use different parameters: a branch chosen by rank (DeepSpeed's
``test_zero_leaf_module`` ``ChooseModuleByRankModel``), a mixture-of-experts block routing each rank's tokens to
different experts (transformers 4.x Mixtral's loop over the experts hit), a leaf whose input needs no gradient, and
``coalesce_grad_reduction``. Each trains on 2 ranks at stage 3 like one process averaging the two ranks' losses
(DeepSpeed's result: an unused parameter's gradient counts as zero). Also the config key
``zero_optimization.leaf_module`` (classes, names, suffixes, DeepSpeed's default MoE classes)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.testing import run_distributed
from hf_zero.zero import get_z3_leaf_modules, set_z3_leaf_modules

H, STEPS, LR = 8, 3, 0.1


class ChooseByRank(nn.Module):
    """Rank r runs ``linears[r]`` only (DeepSpeed's ChooseModuleByRankModel, the loss outside)."""

    def __init__(self):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)])

    def forward(self, x, rank):
        return torch.relu(self.linears[rank](x))


class LoopMoE(nn.Module):
    """Top-1 routing over 4 experts, running only the experts some token was routed to (transformers 4.x)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, 4, bias=False)
        self.experts = nn.ModuleList([nn.Linear(H, H) for _ in range(4)])

    def forward(self, x, rank=None):
        probs = self.gate(x).softmax(-1)
        weight, chosen = probs.max(-1)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            mask = chosen == e
            out[mask] = self.experts[e](x[mask]) * weight[mask, None]
        return out


class Net(nn.Module):
    """embedding -> block (the leaf) -> head; ``first_is_leaf`` puts the leaf first, where no input needs grad."""

    def __init__(self, block_cls, first_is_leaf=False):
        super().__init__()
        self.first_is_leaf = first_is_leaf
        self.inp = nn.Linear(H, H)
        self.block = block_cls()
        self.head = nn.Linear(H, 1)

    def forward(self, x, rank):
        h = self.block(x, rank) + self.inp(x) if self.first_is_leaf else self.block(self.inp(x), rank)
        return self.head(h).squeeze(-1)


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    # each rank's tokens lie on their own side of the space, so top-1 routing sends them to different experts
    x = torch.randn(6, H, generator=g) + (3.0 if rank == 0 else -3.0)
    return x, torch.randn(6, generator=g)


def _model(block_cls, first_is_leaf):
    torch.manual_seed(0)
    return Net(block_cls, first_is_leaf)


def _reference(block_cls, first_is_leaf=False):
    """One process: the mean of both ranks' losses, SGD."""
    model = _model(block_cls, first_is_leaf)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for s in range(STEPS):
        per_rank = [nn.functional.mse_loss(model(*_data(s, r)[:1], r), _data(s, r)[1]) for r in range(2)]
        opt.zero_grad()
        ((per_rank[0] + per_rank[1]) / 2).backward()
        opt.step()
        losses.append([v.item() for v in per_rank])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(threshold, **zero):
    return {"train_micro_batch_size_per_gpu": 6, "steps_per_print": 1000, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold, **zero}}


def _train(block_cls, *, first_is_leaf=False, threshold=0, set_leaf=True, coalesce=False, **zero):
    from deepspeed.utils import safe_get_full_fp32_param  # hf_zero's compatibility layer answers this name

    rank = dist.get_rank()
    model = _model(block_cls, first_is_leaf)
    if set_leaf:
        set_z3_leaf_modules(model, [block_cls])
    engine, *_ = hf_zero.initialize(model=model, config=_config(threshold, **zero))
    losses = []
    for s in range(STEPS):
        x, y = _data(s, rank)
        if coalesce:
            with engine.coalesce_grad_reduction():
                loss = nn.functional.mse_loss(engine(x, rank), y)
                engine.backward(loss)
        else:
            loss = nn.functional.mse_loss(engine(x, rank), y)
            engine.backward(loss)
        engine.step()
        both = [torch.zeros(()), torch.zeros(())]
        dist.all_gather(both, loss.detach())
        losses.append([v.item() for v in both])
    params = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    leaves = [type(m).__name__ for m in get_z3_leaf_modules(model)]
    engine.destroy()
    return losses, params, leaves


def _qwen_moe(stage):
    """A tiny Qwen2-MoE: DeepSpeed's default leaf_module classes make its sparse MoE blocks leaves at stage 3."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=1,
        max_position_embeddings=32))
    engine, *_ = hf_zero.initialize(model=model, config={**_config(0), "zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 0}})
    rank = dist.get_rank()
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))  # the same batch: loss falls
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    leaves = [type(m).__name__ for m in get_z3_leaf_modules(model)]
    engine.destroy()
    return losses, leaves


def _ranks():
    out = {
        "qwen_moe": (_qwen_moe(2), _qwen_moe(3)),
        "by_rank": _train(ChooseByRank),
        "by_rank_persistent": _train(ChooseByRank, threshold=100_000),  # small parameters stay whole
        "moe": _train(LoopMoE),
        "moe_first": _train(LoopMoE, first_is_leaf=True),
        "moe_coalesced": _train(LoopMoE, coalesce=True),
        # the config key instead of set_z3_leaf_modules: a name, a suffix, a class name given as one string
        "config_name": _train(LoopMoE, set_leaf=False, leaf_module={"names": ["block"]}),
        "config_suffix": _train(LoopMoE, set_leaf=False, leaf_module={"name_suffixes": "ock"}),
        "config_class": _train(LoopMoE, set_leaf=False, leaf_module={"classes": "LoopMoE"}),
    }
    try:  # without the leaf, the ranks' different experts are a divergence hf_zero names
        _train(LoopMoE, set_leaf=False)
    except RuntimeError as e:
        out["no_leaf_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_ranks, 2, timeout_s=300)


@pytest.mark.parametrize("case,block,first", [
    ("by_rank", ChooseByRank, False), ("by_rank_persistent", ChooseByRank, False), ("moe", LoopMoE, False),
    ("moe_first", LoopMoE, True), ("moe_coalesced", LoopMoE, False), ("config_name", LoopMoE, False),
    ("config_suffix", LoopMoE, False), ("config_class", LoopMoE, False)])
def test_a_leaf_whose_ranks_use_different_parameters_trains_like_one_process(results, case, block, first):
    ref_losses, ref_params = _reference(block, first)
    for rank in range(2):
        losses, params, leaves = results[rank][case]
        assert leaves == [block.__name__]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-5, atol=1e-6, msg=f"{case} rank {rank} {n}")
    # the data does route the ranks to different experts: otherwise this test would not test the leaf
    if block is LoopMoE:
        assert "no_leaf_error" in results[0]


def test_deepspeeds_default_leaf_classes_apply_to_a_transformers_moe_model(results):
    for rank in range(2):
        (losses2, _), (losses3, leaves3) = results[rank]["qwen_moe"]
        assert leaves3 == ["Qwen2MoeSparseMoeBlock"] * 2
        torch.testing.assert_close(torch.tensor(losses3), torch.tensor(losses2), rtol=1e-5, atol=1e-6)
        assert losses3[-1] < losses3[0]


def test_without_the_leaf_the_different_experts_are_named_as_a_divergence(results):
    error = results[0]["no_leaf_error"]
    assert "diverge" in error and "block.experts" in error and "zero_optimization.leaf_module" in error


def test_leaf_module_config_defaults_and_warnings(caplog):
    from hf_zero.config import load_config
    from hf_zero.config.sections import LEAF_MODULE_DEFAULT_CLASSES
    from hf_zero.zero.leaf import apply_leaf_module_config

    cfg = load_config(_config(0), world_size=1)
    assert cfg.zero.leaf_module.classes == LEAF_MODULE_DEFAULT_CLASSES and not cfg.zero.leaf_module.customized
    model = _model(LoopMoE, False)
    with caplog.at_level(logging.WARNING, logger="hf_zero.zero.leaf"):
        assert apply_leaf_module_config(model, LEAF_MODULE_DEFAULT_CLASSES) == []  # defaults: silent
        assert caplog.records == []
        found = apply_leaf_module_config(model, ("LoopMoE",), ("nope",), ("ock", "zzz"), warn_unmatched=True)
    assert found == [model.block]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "leaf_module.names ['nope']" in text and "leaf_module.name_suffixes ['zzz']" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_zero.zero.leaf"):
        assert apply_leaf_module_config(_model(LoopMoE, False), ("Nope",), warn_unmatched=True) == []
    assert "matched no module" in caplog.records[-1].getMessage()
