"""LayerNorm / RMSNorm kernels and the fused residual-add variants against their references (values, gradients,
opcheck), in fp32, bf16 and fp16."""

import pytest
import torch
from _ops_util import DEVICES, requires_native

from hf_zero.ops.norm import (
    add_layer_norm,
    add_layer_norm_reference,
    add_rms_norm,
    add_rms_norm_reference,
    layer_norm,
    layer_norm_reference,
    rms_norm,
    rms_norm_reference,
)

pytestmark = requires_native

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) for values and gradients per dtype: both sides accumulate in fp32; 16-bit rounding dominates.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
SHAPE = (3, 5, 96)  # (B, T, C)


def _inputs(device, dtype, with_residual=False):
    torch.manual_seed(0)
    x = (torch.randn(SHAPE, device=device) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(SHAPE[-1], device=device) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(SHAPE[-1], device=device).to(dtype).requires_grad_()
    r = torch.randn(SHAPE, device=device).to(dtype).requires_grad_() if with_residual else None
    return x, w, b, r


def _grads(outputs, inputs, seed=1):
    torch.manual_seed(seed)
    cotangents = [torch.randn_like(o) for o in outputs]
    return torch.autograd.grad(outputs, inputs, cotangents)


def _compare(ours, ref, dtype):
    rtol, atol = TOL[dtype]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol * max(1.0, b.float().abs().max().item()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(device, dtype):
    x, w, b, _ = _inputs(device, dtype)
    out = layer_norm(x, w, b, 1e-5)
    ref = layer_norm_reference(x, w, b, 1e-5)
    assert out.dtype == dtype
    _compare([out], [ref], dtype)
    _compare(_grads([out], [x, w, b]), _grads([ref], [x, w, b]), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(device, dtype):
    x, w, _, _ = _inputs(device, dtype)
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    assert out.dtype == dtype
    _compare([out], [ref], dtype)
    _compare(_grads([out], [x, w]), _grads([ref], [x, w]), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm(device, dtype):
    x, w, b, r = _inputs(device, dtype, with_residual=True)
    out = add_layer_norm(x, r, w, b, 1e-5)
    ref = add_layer_norm_reference(x, r, w, b, 1e-5)
    _compare(out, ref, dtype)
    _compare(_grads(out, [x, r, w, b]), _grads(ref, [x, r, w, b]), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(device, dtype):
    x, w, _, r = _inputs(device, dtype, with_residual=True)
    out = add_rms_norm(x, r, w, 1e-6)
    ref = add_rms_norm_reference(x, r, w, 1e-6)
    _compare(out, ref, dtype)
    _compare(_grads(out, [x, r, w]), _grads(ref, [x, r, w]), dtype)


def test_rms_norm_fp32_matches_llama_exactly_enough():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 7, 96)
    torch.testing.assert_close(rms_norm(x, module.weight, 1e-6), module(x), rtol=1e-6, atol=1e-6)


def test_optional_weight_and_bias():
    x = torch.randn(4, 32, requires_grad=True)
    torch.testing.assert_close(layer_norm(x, None, None, 1e-5), layer_norm_reference(x, None, None, 1e-5))
    torch.testing.assert_close(rms_norm(x, None, 1e-6), rms_norm_reference(x, None, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_norm_opcheck(device):
    x, w, b, r = _inputs(device, torch.float32, with_residual=True)
    ops = torch.ops.hf_zero
    torch.library.opcheck(ops.layer_norm_fwd.default, (x, w, b, 1e-5))
    torch.library.opcheck(ops.add_layer_norm_fwd.default, (x, r, w, b, 1e-5))
    torch.library.opcheck(ops.rms_norm_fwd.default, (x, w, 1e-6))
    torch.library.opcheck(ops.add_rms_norm_fwd.default, (x, r, w, 1e-6))
    xd, wd = x.detach(), w.detach()
    _, mean, rstd = ops.layer_norm_fwd(xd, wd, b.detach(), 1e-5)
    torch.library.opcheck(ops.layer_norm_bwd.default, (torch.randn_like(xd), xd, mean, rstd, wd))
    _, rrstd = ops.rms_norm_fwd(xd, wd, 1e-6)
    torch.library.opcheck(ops.rms_norm_bwd.default, (torch.randn_like(xd), xd, rrstd, wd))
