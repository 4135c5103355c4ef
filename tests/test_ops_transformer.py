"""Fused bias+GeLU, scaled masked softmax and rotary embedding against their references (values, gradients,
opcheck)."""

import pytest
import torch
from _ops_util import DEVICES, requires_native

from hf_zero.ops.transformer import (
    apply_rotary,
    apply_rotary_pos_emb,
    apply_rotary_reference,
    bias_gelu,
    bias_gelu_reference,
    scaled_masked_softmax,
    scaled_masked_softmax_reference,
)

pytestmark = requires_native

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _check(ours, ref, inputs, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(ours.float(), ref.float(), rtol=rtol, atol=atol)
    cot = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, inputs, cot), torch.autograd.grad(ref, inputs, cot)):
        scale = max(1.0, b.float().abs().max().item())
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu(device, dtype, approximate, with_bias):
    torch.manual_seed(0)
    x = (torch.randn(4, 9, 80, device=device) * 3).to(dtype).requires_grad_()
    bias = torch.randn(80, device=device).to(dtype).requires_grad_() if with_bias else None
    inputs = [x, bias] if with_bias else [x]
    _check(bias_gelu(x, bias, approximate), bias_gelu_reference(x, bias, approximate), inputs, dtype)


def test_bias_gelu_matches_hf_activations():
    from transformers.activations import GELUActivation, NewGELUActivation

    x = torch.randn(5, 64) * 3
    torch.testing.assert_close(bias_gelu(x, None, "tanh"), NewGELUActivation()(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias_gelu(x, None, "none"), GELUActivation()(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_masked_softmax(device, dtype):
    torch.manual_seed(0)
    B, H, S = 2, 3, 17  # (B, H, Sq, Sk) scores, (B, 1, Sq, Sk) causal mask broadcast over heads
    x = (torch.randn(B, H, S, S, device=device) * 4).to(dtype).requires_grad_()
    mask = torch.ones(S, S, dtype=torch.bool, device=device).triu(1).expand(B, 1, S, S).clone()
    mask[1, 0, 5] = True  # one row fully masked -> zeros
    out = scaled_masked_softmax(x, mask, 0.125)
    ref = scaled_masked_softmax_reference(x, mask, 0.125)
    assert torch.all(out[1, :, 5] == 0)
    _check(out, ref, [x], dtype)
    _check(scaled_masked_softmax(x, None, 0.5), scaled_masked_softmax_reference(x, None, 0.5), [x], dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_llama(device, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    B, H, S, D = 2, 4, 11, 16
    q = torch.randn(B, H, S, D, device=device).to(dtype).requires_grad_()
    k = torch.randn(B, H, S, D, device=device).to(dtype).requires_grad_()
    position_ids = torch.arange(S, device=device).expand(B, S)
    cos, sin = LlamaRotaryEmbedding(config).to(device)(q, position_ids)  # (B, S, D) in q's dtype
    ours = apply_rotary_pos_emb(q, k, cos, sin)
    theirs = hf_apply(q, k, cos, sin)
    for a, b, inp in zip(ours, theirs, (q, k)):
        _check(a, b, [inp], dtype)


def test_rotary_grad_of_tables():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64).float().requires_grad_()
    cos = torch.randn(2, 1, 5, 8).requires_grad_()
    sin = torch.randn(2, 1, 5, 8).requires_grad_()
    _check(apply_rotary(x, cos, sin), apply_rotary_reference(x, cos, sin), [x, cos, sin], torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_transformer_opcheck(device):
    ops = torch.ops.hf_zero
    x = torch.randn(3, 4, 32, device=device, requires_grad=True)
    bias = torch.randn(32, device=device, requires_grad=True)
    torch.library.opcheck(ops.bias_gelu.default, (x, bias, "tanh"))
    torch.library.opcheck(ops.bias_gelu.default, (x, None, "none"))
    mask = torch.rand(3, 1, 32, device=device) > 0.7
    torch.library.opcheck(ops.scaled_masked_softmax.default, (x, mask, 0.3))
    cos = torch.randn(1, 4, 32, device=device)
    sin = torch.randn(1, 4, 32, device=device)
    torch.library.opcheck(ops.apply_rotary.default, (x, cos, sin))
    xd = x.detach()
    torch.library.opcheck(ops.bias_gelu_bwd.default, (torch.randn_like(xd), xd, bias.detach(), "tanh"))
    torch.library.opcheck(ops.scaled_softmax_bwd.default, (torch.randn_like(xd), xd.softmax(-1), 0.3))
    torch.library.opcheck(ops.apply_rotary_bwd.default, (torch.randn_like(xd), cos, sin))
