"""``deepspeed.moe.layer.MoE`` and ``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``:
gating arithmetic checked by hand, the layer against a token-by-token computation, and training with
data-parallel experts on 2 ranks (ZeRO-2 and ZeRO-3) against one process running each rank's micro-batch.
Expert parallelism (ep_size > 1): tests/test_moe_expert_parallel.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from hf_zero.integrations.deepspeed_shim._finder import install
from hf_zero.moe import MoE, is_moe_param, split_params_into_different_moe_groups_for_optimizer
from hf_zero.moe.gating import top1gating, top2gating
from hf_zero.testing import run_distributed

H, E, STEPS, BATCH, LR = 6, 4, 3, 5, 0.02


def test_top1_gating_capacity_drop_and_aux_loss():
    # 5 tokens, 2 experts; tokens 0, 1, 2, 4 prefer expert 0, token 3 prefers expert 1; capacity ceil(5/2*0.8)=2
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.0, 1.0], [0.5, 0.0]])
    l_aux, combine, dispatch, counts = top1gating(logits, capacity_factor=0.8, min_capacity=1, use_rts=False)
    gates = torch.softmax(logits, dim=1)
    assert counts.tolist() == [4, 1]
    assert combine.shape == (5, 2, 2)
    kept = combine.sum(dim=(1, 2)) > 0
    assert kept.sum().item() == 3 and kept[3]  # expert 0 keeps 2 of its 4 tokens, expert 1 its one
    for s in range(5):
        if kept[s]:
            e = int(torch.argmax(gates[s]))
            assert combine[s, e].sum().item() == pytest.approx(gates[s, e].item())
    # every kept token of an expert has its own slot
    assert (dispatch.sum(dim=0) <= 1).all()
    expected_aux = (gates.mean(dim=0) * torch.tensor([4 / 5, 1 / 5])).sum() * 2
    assert l_aux.item() == pytest.approx(expected_aux.item())


def test_top2_gating_weights_are_normalised_pairs():
    torch.manual_seed(0)
    logits = torch.randn(7, 3)
    _, combine, _, counts = top2gating(logits, capacity_factor=4.0, min_capacity=1, top2_2nd_expert_sampling=False)
    assert counts.sum().item() == 14  # two experts per token
    per_token = combine.sum(dim=2)  # (s, e)
    assert torch.allclose(per_token.sum(dim=1), torch.ones(7))
    top2 = torch.topk(torch.softmax(logits, 1), 2, dim=1)
    for s in range(7):
        w = top2.values[s] / top2.values[s].sum()
        assert per_token[s, top2.indices[s, 0]].item() == pytest.approx(w[0].item(), rel=1e-5)
        assert per_token[s, top2.indices[s, 1]].item() == pytest.approx(w[1].item(), rel=1e-5)


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))


def test_moe_output_equals_token_by_token_experts():
    torch.manual_seed(1)
    moe = MoE(H, _expert(), num_experts=E, k=1, capacity_factor=float(E), use_rts=False)
    x = torch.randn(2, 5, H)
    out, l_aux, counts = moe(x)
    gates = torch.softmax(moe.deepspeed_moe.gate.wg(x.reshape(-1, H)), dim=1)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    expected = torch.stack([gates[s].max() * experts[int(gates[s].argmax())](tok)
                            for s, tok in enumerate(x.reshape(-1, H))]).reshape(x.shape)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert counts.sum().item() == 10 and l_aux.dim() == 0
    assert all(is_moe_param(p) and p.group_name == "ep_size_1" for p in experts.parameters())
    assert not is_moe_param(moe.deepspeed_moe.gate.wg.weight)


def test_moe_refuses_what_it_does_not_do():
    with pytest.raises(ValueError, match="ep_size=3"):  # expert parallelism: tests/test_moe_expert_parallel.py
        MoE(H, _expert(), num_experts=4, ep_size=3)
    with pytest.raises(NotImplementedError, match="use_tutel"):
        MoE(H, _expert(), num_experts=4, use_tutel=True)
    with pytest.raises(ValueError, match="k=3"):
        MoE(H, _expert(), num_experts=4, k=3)


def test_split_params_into_moe_groups():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(H, H), MoE(H, _expert(), num_experts=E))
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all", "lr": 0.1, "weight_decay": 0.0})
    assert [g["name"] for g in groups] == ["all", "ep_size_1"]
    dense, moe = groups
    assert moe["moe"] is True and moe["lr"] == 0.1 and "moe" not in dense
    assert all(is_moe_param(p) for p in moe["params"]) and not any(is_moe_param(p) for p in dense["params"])
    assert len(dense["params"]) + len(moe["params"]) == len(list(model.parameters()))
    expert_numel = sum(p.numel() for p in _expert().parameters())
    small = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters())}],
                                                                 max_group_size=expert_numel)
    assert sum(1 for g in small if g.get("moe")) == E  # each expert's parameters fill one capped group
    install()
    assert importlib.import_module("deepspeed.moe.layer").MoE is MoE
    assert importlib.import_module("deepspeed.moe.utils").split_params_into_different_moe_groups_for_optimizer \
        is split_params_into_different_moe_groups_for_optimizer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, H)
        # top-2, capacity small enough that tokens are dropped: the per-rank capacity must be reproduced exactly
        self.moe = MoE(H, _expert(), num_experts=E, k=2, capacity_factor=0.5, min_capacity=1, use_rts=False,
                       top2_2nd_expert_sampling=False, use_residual=True)
        self.out = nn.Linear(H, 1)

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h), l_aux


def _data():
    g = torch.Generator().manual_seed(4)
    return torch.randn(STEPS, 2, BATCH, 3, generator=g), torch.randn(STEPS, 2, BATCH, 1, generator=g)


def _loss(model, x, y):
    pred, l_aux = model(x)
    return nn.functional.mse_loss(pred, y) + 0.01 * l_aux


def _ranks(stages):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    from deepspeed.utils import safe_get_full_fp32_param

    rank = torch.distributed.get_rank()
    x, y = _data()
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model = Net()
        groups = split({"params": list(model.parameters()), "name": "params"})
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config={
            "train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": LR}}, "steps_per_print": 1000})
        losses = []
        for s in range(STEPS):
            loss = _loss(engine, x[s, rank], y[s, rank])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / 2)
        out[stage] = (losses, {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()})
        engine.destroy()
    return out


def test_data_parallel_experts_train_like_one_process():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"}), lr=LR)
    x, y = _data()
    ref_losses = []
    for s in range(STEPS):
        # each rank routes its own micro-batch (capacity is per micro-batch); the ranks' gradients are averaged
        losses = [_loss(model, x[s, r], y[s, r]) for r in range(2)]
        loss = (losses[0] + losses[1]) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    results = run_distributed(_ranks, world_size=2, args=((2, 3),), timeout_s=300)
    for stage in (2, 3):
        losses, params = results[0][stage]
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6, msg=f"stage {stage} {n}")
