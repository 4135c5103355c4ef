"""Fused Adam: CPUAdam / FusedAdam track torch.optim.AdamW and Adam; adam_step_ matches its reference."""

import copy

import pytest
import torch
from _ops_util import DEVICES, requires_native

from hf_zero.ops.adam import CPUAdam, FusedAdam, adam_step_, adam_step_reference

STEPS = 10


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the scale of b (elementwise relative error is meaningless near zero)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _allow_any_grad_dtype(p: torch.Tensor) -> torch.Tensor:
    # fp32 master params with bf16 grads (what the engine's flat partitions hold); torch >= 2.10 checks
    # p.grad's dtype against p.grad_dtype unless it is None.
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None
    return p


def _make_params(device="cpu"):
    torch.manual_seed(0)
    return [torch.randn(257, 33, device=device), torch.randn(1000, device=device), torch.randn(3, device=device)]


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_cpu_adam_tracks_torch(adamw_mode, weight_decay, bias_correction, grad_dtype):
    base = _make_params()
    ours = [_allow_any_grad_dtype(p.clone().requires_grad_()) for p in base]
    theirs = [p.clone().requires_grad_() for p in base]
    opt = CPUAdam(ours, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay,
                  bias_correction=bias_correction, adamw_mode=adamw_mode)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = ref_cls(theirs, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    if not bias_correction:
        # torch has no switch for it: bias correction off == torch with (1 - beta^step) pinned to 1, which
        # the reference function reproduces; compare against it instead.
        ref = None
        states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in base]
    for step in range(1, STEPS + 1):
        grads = [torch.randn_like(p).to(grad_dtype) for p in base]
        for p, g in zip(ours, grads):
            p.grad = g
        opt.step()
        if ref is not None:
            for p, g in zip(theirs, grads):
                p.grad = g.float()
            ref.step()
        else:
            with torch.no_grad():
                for p, g, (m, v) in zip(theirs, grads, states):
                    adam_step_reference(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                                        weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=False)
    for a, b in zip(ours, theirs):
        assert _max_rel(a.detach(), b.detach()) < 1e-6


def test_cpu_adam_16bit_params_and_states():
    base = _make_params()
    for fp32_states in (True, False):
        ours = [p.to(torch.bfloat16).requires_grad_() for p in base]
        master = [p.clone().requires_grad_() for p in base]
        opt = CPUAdam(ours, lr=1e-3, fp32_optimizer_states=fp32_states)
        ref = torch.optim.AdamW(master, lr=1e-3)
        for _ in range(3):
            for p, q in zip(ours, master):
                g = torch.randn_like(q)
                p.grad, q.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
            opt.step()
            ref.step()
            with torch.no_grad():  # the bf16 params carry no fp32 master: round the reference the same way
                for q in master:
                    q.copy_(q.to(torch.bfloat16).float())
        expected_state = torch.float32 if fp32_states else torch.bfloat16
        assert opt.state[ours[0]]["exp_avg"].dtype == expected_state
        for p, q in zip(ours, master):
            torch.testing.assert_close(p.float(), q.detach(), rtol=1e-2, atol=1e-2)


def test_cpu_adam_rejects_amsgrad():
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([torch.zeros(2, requires_grad=True)], amsgrad=True)


def test_cpu_adam_state_dict_roundtrip():
    params = [p.requires_grad_() for p in _make_params()]
    opt = CPUAdam(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    opt2 = CPUAdam([p.detach().clone().requires_grad_() for p in params], lr=1e-3)
    opt2.load_state_dict(state)
    assert opt2.state_dict()["state"][0]["step"] == 1


@requires_native
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out16_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_adam_step_matches_reference(device, grad_dtype, out16_dtype, adamw_mode):
    torch.manual_seed(1)
    numel = 100_003  # odd: exercises the loop remainders and several OpenMP chunks
    param = torch.randn(numel, device=device)
    exp_avg = torch.randn(numel, device=device) * 0.1
    exp_avg_sq = torch.rand(numel, device=device) * 0.1
    states = [(param.clone(), exp_avg.clone(), exp_avg_sq.clone()) for _ in range(2)]
    out16 = [None if out16_dtype is None else torch.empty(numel, device=device, dtype=out16_dtype) for _ in range(2)]
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode,
                  bias_correction=True, grad_scale=128.0)
    for step in range(1, 4):
        grad = (torch.randn(numel, device=device) * 128).to(grad_dtype)
        adam_step_(states[0][0], grad, states[0][1], states[0][2], step=step, out16=out16[0], **kwargs)
        adam_step_reference(states[1][0], grad, states[1][1], states[1][2], step=step, out16=out16[1], **kwargs)
    for a, b in zip(states[0], states[1]):
        assert _max_rel(a, b) < 1e-6
    if out16_dtype is not None:
        torch.testing.assert_close(out16[0], states[0][0].to(out16_dtype), rtol=0, atol=0)


@requires_native
@pytest.mark.parametrize("device", DEVICES)
def test_adam_opcheck(device):
    param = torch.randn(64, device=device)
    args = (param, torch.randn(64, device=device, dtype=torch.bfloat16), torch.zeros(64, device=device),
            torch.zeros(64, device=device), torch.empty(64, device=device, dtype=torch.bfloat16),
            1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True, 2.0)
    torch.library.opcheck(torch.ops.hf_zero.adam_step.default, args)
    lists = ([torch.randn(5, device=device), torch.randn(9, device=device)],
             [torch.randn(5, device=device), torch.randn(9, device=device)],
             [torch.zeros(5, device=device), torch.zeros(9, device=device)],
             [torch.zeros(5, device=device), torch.zeros(9, device=device)])
    torch.library.opcheck(torch.ops.hf_zero.multi_tensor_adam.default,
                          (*lists, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam_matches_cpu_adam(device):
    base = _make_params(device)
    a = [p.clone().requires_grad_() for p in base]
    b = [p.clone().requires_grad_() for p in base]
    opt_a = FusedAdam(a, lr=1e-2, weight_decay=0.01)
    opt_b = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.01)
    for _ in range(STEPS):
        for p, q in zip(a, b):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        assert _max_rel(p.detach(), q.detach()) < 1e-6


# ---------------------------------------------------------------- the CPU kernel's SIMD paths


def _cpu_isas() -> list[str]:
    """The CPU Adam paths this machine can run: "scalar" always, then "avx2" and "avx512" where supported."""
    best = torch.ops.hf_zero.adam_cpu_isa("auto")
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(best) + 1]


@pytest.fixture
def cpu_isa():
    """Selects a CPU Adam path for the test (``cpu_isa("avx2")``); the widest one is restored afterwards."""
    yield lambda isa: torch.ops.hf_zero.adam_cpu_isa(isa)
    torch.ops.hf_zero.adam_cpu_isa("auto")


# Lengths around the vector widths (8, 16), the prefetch distances (512 and 2048, + a vector) and
# the threads' block (131072: 262147 is two blocks and a tail).
SIMD_NUMELS = [1, 7, 8, 9, 15, 16, 17, 63, 65, 527, 528, 529, 1057, 2063, 2064, 2065, 4099, 100_003, 262_147]
SIMD_CASES = [  # (grad dtype, out16 dtype, adamw_mode, weight_decay, bias_correction, grad_scale)
    (torch.float32, None, True, 0.1, True, 1.0),
    (torch.float32, None, False, 0.1, True, 1.0),
    (torch.float32, None, True, 0.0, False, 1.0),
    (torch.bfloat16, torch.bfloat16, True, 0.1, True, 128.0),
    (torch.bfloat16, torch.float16, False, 0.1, False, 1.0),
    (torch.float16, torch.bfloat16, True, 0.0, True, 64.0),
    (torch.float16, torch.float16, False, 0.05, True, 1.0),
    (torch.float32, torch.bfloat16, True, 0.1, True, 1.0),
]


def _simd_inputs(numel: int, grad_dtype, param_dtype=torch.float32):
    gen = torch.Generator().manual_seed(numel)
    param = torch.randn(numel, generator=gen).to(param_dtype)
    exp_avg = torch.randn(numel, generator=gen) * 0.1
    exp_avg_sq = torch.rand(numel, generator=gen) * 0.1
    grads = [(torch.randn(numel, generator=gen) * 64).to(grad_dtype) for _ in range(3)]
    return param, exp_avg, exp_avg_sq, grads


def _run_steps(isa_fn, isa, param, exp_avg, exp_avg_sq, grads, out16_dtype, **kwargs):
    isa_fn(isa)
    state = [param.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    out16 = None if out16_dtype is None else torch.empty(param.numel(), dtype=out16_dtype)
    for step, grad in enumerate(grads, start=1):
        adam_step_(*state[:1], grad, *state[1:], step=step, out16=out16, **kwargs)
    return state, out16


@requires_native
@pytest.mark.parametrize("numel", SIMD_NUMELS)
@pytest.mark.parametrize("case", SIMD_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_adam_cpu_simd_paths_match_scalar_and_reference(cpu_isa, numel, case):
    """Every SIMD path computes what the scalar loop computes, bit for bit (same operations, same order; tails
    included), and the scalar loop tracks the pure-PyTorch reference."""
    grad_dtype, out16_dtype, adamw_mode, weight_decay, bias_correction, grad_scale = case
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, adamw_mode=adamw_mode,
                  bias_correction=bias_correction, grad_scale=grad_scale)
    inputs = _simd_inputs(numel, grad_dtype)
    scalar, scalar16 = _run_steps(cpu_isa, "scalar", *inputs, out16_dtype, **kwargs)
    for isa in _cpu_isas()[1:]:
        simd, simd16 = _run_steps(cpu_isa, isa, *inputs, out16_dtype, **kwargs)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), simd, scalar):
            assert torch.equal(a, b), f"{isa} differs from scalar in {name} (numel {numel})"
        if out16_dtype is not None:
            assert torch.equal(simd16, scalar16), f"{isa} differs from scalar in out16 (numel {numel})"
            assert torch.equal(simd16, simd[0].to(out16_dtype)), f"{isa}: out16 is not param rounded"
    param, exp_avg, exp_avg_sq, grads = inputs
    ref = [param.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    for step, grad in enumerate(grads, start=1):
        adam_step_reference(ref[0], grad, ref[1], ref[2], step=step, **kwargs)
    for a, b in zip(scalar, ref):
        assert _max_rel(a, b) < 1e-6


@requires_native
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [17, 1057, 100_003])
def test_adam_step_16bit_param_in_place(cpu_isa, param_dtype, grad_dtype, numel):
    """A bf16/fp16 param (no fp32 master) is updated in fp32 and rounded once: every path agrees bit for bit,
    and with the reference (fp32 update of the 16-bit value, rounded) to within one 16-bit rounding."""
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                  bias_correction=True)
    inputs = _simd_inputs(numel, grad_dtype, param_dtype)
    results = {isa: _run_steps(cpu_isa, isa, *inputs, None, **kwargs)[0] for isa in _cpu_isas()}
    scalar = results["scalar"]
    assert scalar[0].dtype == param_dtype
    for isa, state in results.items():
        for a, b in zip(state, scalar):
            assert torch.equal(a, b), f"{isa} differs from scalar"
    param, exp_avg, exp_avg_sq, grads = inputs
    ref = [param.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    for step, grad in enumerate(grads, start=1):
        adam_step_reference(ref[0], grad, ref[1], ref[2], step=step, **kwargs)
    ulp = 2.0**-7 if param_dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(scalar[0].float(), ref[0].float(), rtol=ulp, atol=1e-3)
    for a, b in zip(scalar[1:], ref[1:]):
        assert _max_rel(a, b) < 1e-5


@requires_native
def test_adam_cpu_isa_rejects_unknown_path():
    with pytest.raises(RuntimeError, match="unknown path"):
        torch.ops.hf_zero.adam_cpu_isa("sse9")
    assert torch.ops.hf_zero.adam_cpu_isa() in ("scalar", "avx2", "avx512")
