"""CPUAdagrad / CPULion (``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``, ``deepspeed.ops.lion.DeepSpeedCPULion``):
the references follow torch.optim.Adagrad and the Lion paper's update, the compiled kernels follow the references,
and the engine trains with them as client optimizers under ZeRO (the shard update equals the full-tensor one)."""

from __future__ import annotations

import importlib

import pytest
import torch
from _ops_util import requires_native

from hf_zero.integrations.deepspeed_shim._finder import install
from hf_zero.ops import adagrad as adagrad_mod
from hf_zero.ops import lion as lion_mod
from hf_zero.ops.adagrad import CPUAdagrad, adagrad_step_, adagrad_step_reference
from hf_zero.ops.lion import CPULion, lion_step_, lion_step_reference
from hf_zero.testing import run_distributed

STEPS = 8


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _params():
    torch.manual_seed(0)
    return [torch.randn(129, 17), torch.randn(1000), torch.randn(3)]


def _lion_paper(params, grads_per_step, lr, betas, wd):
    """Lion written out from the paper (Chen et al. 2023, Algorithm 2), one tensor at a time."""
    params = [p.clone() for p in params]
    moms = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for p, m, g in zip(params, moms, grads):
            c = betas[0] * m + (1 - betas[0]) * g
            p.mul_(1 - lr * wd).add_(torch.sign(c), alpha=-lr)
            m.mul_(betas[1]).add_((1 - betas[1]) * g)
    return params, moms


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cpu_adagrad_tracks_torch_adagrad(weight_decay):
    base = _params()
    ours = [p.clone().requires_grad_() for p in base]
    theirs = [p.clone().requires_grad_() for p in base]
    opt = CPUAdagrad(ours, lr=0.05, eps=1e-10, weight_decay=weight_decay)
    ref = torch.optim.Adagrad(theirs, lr=0.05, eps=1e-10, weight_decay=weight_decay)
    for _ in range(STEPS):
        grads = [torch.randn_like(p) for p in base]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        assert _max_rel(p.detach(), q.detach()) < 1e-6
        assert _max_rel(opt.state[p]["exp_avg_sq"], ref.state[q]["sum"]) < 1e-6
    assert opt.state[ours[0]]["step"] == STEPS


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cpu_lion_tracks_the_papers_update(weight_decay):
    base = _params()
    ours = [p.clone().requires_grad_() for p in base]
    opt = CPULion(ours, lr=0.01, betas=(0.9, 0.99), weight_decay=weight_decay)
    torch.manual_seed(1)
    grads_per_step = [[torch.randn_like(p) for p in base] for _ in range(STEPS)]
    for grads in grads_per_step:
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
    expected, moms = _lion_paper(base, grads_per_step, 0.01, (0.9, 0.99), weight_decay)
    for p, e, m in zip(ours, expected, moms):
        assert _max_rel(p.detach(), e) < 1e-6
        assert _max_rel(opt.state[p]["exp_avg"], m) < 1e-6


@requires_native
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out16_dtype", [None, torch.bfloat16])
def test_compiled_kernels_match_references(grad_dtype, out16_dtype):
    if not (adagrad_mod._compiled() and lion_mod._compiled()):
        # the loaded hf_zero._C was compiled from sources older than these kernels (a stale editable build)
        pytest.skip("hf_zero._C predates adagrad_step/lion_step: rebuild (pip install --no-build-isolation -e .) "
                    "to test the kernels")
    torch.manual_seed(2)
    n = 100_003  # several OpenMP chunks plus a ragged tail
    p0, v0 = torch.randn(n), torch.rand(n)
    for step in range(3):
        g = torch.randn(n).to(grad_dtype)
        p_k, v_k, p_r, v_r = p0.clone(), v0.clone(), p0.clone(), v0.clone()
        out_k = None if out16_dtype is None else torch.empty(n, dtype=out16_dtype)
        out_r = None if out16_dtype is None else torch.empty(n, dtype=out16_dtype)
        adagrad_step_(p_k, g, v_k, lr=0.01, eps=1e-8, weight_decay=0.01, grad_scale=2.0, out16=out_k)
        adagrad_step_reference(p_r, g, v_r, lr=0.01, eps=1e-8, weight_decay=0.01, grad_scale=2.0, out16=out_r)
        assert _max_rel(p_k, p_r) < 1e-6 and _max_rel(v_k, v_r) < 1e-6
        if out16_dtype is not None:
            assert torch.equal(out_k, p_k.to(out16_dtype))
        m_k, m_r, q_k, q_r = v0.clone() - 0.5, v0.clone() - 0.5, p0.clone(), p0.clone()
        lion_step_(q_k, g, m_k, lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.01, grad_scale=2.0, out16=out_k)
        lion_step_reference(q_r, g, m_r, lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.01, grad_scale=2.0,
                            out16=out_r)
        # sign() flips only where beta1*m + (1-beta1)*g rounds across zero: allow a handful of such elements
        assert (q_k - q_r).abs().gt(1e-6).sum().item() <= 2
        assert _max_rel(m_k, m_r) < 1e-6
        p0 = p_k


def test_16bit_params_update_through_fp32():
    base = _params()
    for cls, kw in ((CPUAdagrad, {"lr": 0.05}), (CPULion, {"lr": 0.01})):
        p16 = [p.clone().to(torch.bfloat16).requires_grad_() for p in base]
        p32 = [p.clone().to(torch.bfloat16).float().requires_grad_() for p in base]
        o16, o32 = cls(p16, **kw), cls(p32, **kw)
        g = [torch.randn_like(p) for p in base]
        for a, b, gi in zip(p16, p32, g):
            a.grad, b.grad = gi.to(torch.bfloat16), gi.to(torch.bfloat16).float()
        o16.step()
        o32.step()
        for a, b in zip(p16, p32):
            assert torch.equal(a.detach(), b.detach().to(torch.bfloat16))
            assert o16.state[a][next(k for k in o16.state[a] if k != "step")].dtype == torch.float32


def test_deepspeed_names_resolve_to_these_classes():
    install()
    assert importlib.import_module("deepspeed.ops.adagrad").DeepSpeedCPUAdagrad is CPUAdagrad
    assert importlib.import_module("deepspeed.ops.lion").DeepSpeedCPULion is CPULion


def _train(cls_name: str, stage: int):
    import deepspeed
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.lion import DeepSpeedCPULion

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))
    opt = (DeepSpeedCPUAdagrad(model.parameters(), lr=0.05) if cls_name == "adagrad"
           else DeepSpeedCPULion(model.parameters(), lr=0.01, weight_decay=0.1))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
        "steps_per_print": 1000})
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(engine(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4])
        engine.backward(loss)
        engine.step()
    from deepspeed.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p) for p in model.parameters()]


def _train_all():
    return {(name, stage): _train(name, stage) for name in ("adagrad", "lion") for stage in (1, 3)}


def test_engine_trains_with_them_as_client_optimizers():
    """ZeRO-1 and ZeRO-3 on 2 ranks, each optimizer stepping its shard, equal the optimizer on the full model."""
    results = run_distributed(_train_all, world_size=2, timeout_s=300)[0]
    for name in ("adagrad", "lion"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))
        opt = (CPUAdagrad(model.parameters(), lr=0.05) if name == "adagrad"
               else CPULion(model.parameters(), lr=0.01, weight_decay=0.1))
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        for stage in (1, 3):
            for got, want in zip(results[(name, stage)], model.parameters()):
                torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
