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
    # Drawn in the logical (row-major) order whatever an output's strides: the reference keeps a non-contiguous
    # input's layout, the kernels return contiguous outputs, and randn_like would fill each in its memory order.
    cotangents = [torch.randn(o.shape, dtype=o.dtype, device=o.device) for o in outputs]
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


# ---------------------------------------------------------------- CUDA kernel paths
#
# csrc/norm/norm_cuda.cu picks its kernel from D, the dtype and the pointers' alignment (V = 16 / itemsize elements
# per 128-bit access): rows in registers with G threads per row and K vectors per thread when D % V == 0 and every
# pointer is 16-byte aligned (forward: D / V <= 4096; backward: D <= 8192), else a scalar loop. Each shape below is
# named by the paths it takes (bf16 / fp16 first, then fp32 where different).
CUDA_SHAPES = {
    "rows1_d8_one_vector": (1, 8),  # G=1, K=1; fp32 two vectors
    "d24_partial_K": (7, 24),  # bf16: 3 vectors, G=1 with K=4 (one slot empty); fp32: 6 vectors
    "d64_small": (33, 64),  # sub-warp groups, 128 / G rows per block, the last block part empty
    "d96_test_shape": (15, 96),
    "d100_scalar_bf16": (3, 100),  # D % 8 != 0: scalar loop for 16-bit; vectorised for fp32 (D % 4 == 0)
    "d1000_warp": (9, 1000),  # bf16: G=32 (one warp per row, 125 of 128 vectors); fp32: G=64 (two warps)
    "d1001_odd": (6, 1001),  # scalar loop everywhere
    "d4096_block_strided": (2000, 4096),  # a block per row; more rows than one wave of blocks: the grid strides
    "rows1_d4096": (1, 4096),
    "d8192_bwd_registers_max": (5, 8192),  # the largest backward kept in registers
    "d16384_bwd_loop": (4, 16384),  # forward in registers (G=512 / 1024), backward in the scalar loop
    "d40000_fwd_loop": (2, 40000),  # past the forward's register limit
    "d16385_odd_large": (2, 16385),
}
CUDA_DEVICES = [d for d in DEVICES if d == "cuda"] or [
    pytest.param("cuda", marks=pytest.mark.skip(reason="no CUDA GPU with hf_zero._C_cuda"))]
# fp32 compares sums over up to 40000 elements taken in another order than torch's: 5e-5 rather than 1e-5.
PATH_TOL = {**TOL, torch.float32: (5e-5, 5e-5)}


def _path_inputs(rows, D, device, dtype, seed=0, param_dtype=None):
    torch.manual_seed(seed)
    param_dtype = param_dtype or dtype
    x = (torch.randn(rows, D, device=device) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(D, device=device) + 0.5).to(param_dtype).requires_grad_()
    b = torch.randn(D, device=device).to(param_dtype).requires_grad_()
    r = torch.randn(rows, D, device=device).to(dtype).requires_grad_()
    return x, w, b, r


def _compare_tol(ours, ref, tol):
    rtol, atol = tol
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol * max(1.0, b.float().abs().max().item()))


def _check_op(op, x, w, b, r, tol):
    """Values and gradients of every input (one backward through every output) against the reference."""
    if op == "layer_norm":
        ours, ref, inputs = [layer_norm(x, w, b, 1e-5)], [layer_norm_reference(x, w, b, 1e-5)], [x, w, b]
    elif op == "rms_norm":
        ours, ref, inputs = [rms_norm(x, w, 1e-6)], [rms_norm_reference(x, w, 1e-6)], [x, w]
    elif op == "add_layer_norm":
        ours, ref = add_layer_norm(x, r, w, b, 1e-5), add_layer_norm_reference(x, r, w, b, 1e-5)
        inputs = [x, r, w, b]
    else:
        ours, ref, inputs = add_rms_norm(x, r, w, 1e-6), add_rms_norm_reference(x, r, w, 1e-6), [x, r, w]
    _compare_tol(ours, ref, tol)
    _compare_tol(_grads(ours, inputs), _grads(ref, inputs), tol)


OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]


@pytest.mark.parametrize("device", CUDA_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", list(CUDA_SHAPES.values()), ids=list(CUDA_SHAPES))
def test_kernel_paths(device, dtype, op, shape):
    x, w, b, r = _path_inputs(*shape, device, dtype)
    _check_op(op, x, w, b, r, PATH_TOL[dtype])


@pytest.mark.parametrize("device", CUDA_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [8, 96])
def test_kernel_paths_grid_strides_over_many_rows(device, dtype, D):
    """300000 short rows: more row groups than one wave of blocks, forward and backward (the weight gradient adds
    every block's partial row)."""
    x, w, b, _ = _path_inputs(300_000, D, device, dtype)
    _check_op("layer_norm", x, w, b, None, PATH_TOL[dtype])
    _check_op("rms_norm", x, w, b, None, PATH_TOL[dtype])


@pytest.mark.parametrize("device", CUDA_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_kernel_paths_misaligned_and_strided_inputs(device, dtype, op):
    """x one element past a 16-byte boundary (the scalar loop), weight and bias likewise (copied to an aligned
    buffer, the vectorised kernels), and non-contiguous x (made contiguous by the op)."""
    rows, D = 6, 512
    x, w, b, r = _path_inputs(rows, D, device, dtype)
    flat = torch.zeros(rows * D + 1, device=device, dtype=dtype)
    x_off = flat[1:].view(rows, D).copy_(x.detach()).requires_grad_()
    pflat = torch.zeros(2 * D + 1, device=device, dtype=dtype)
    w_off = pflat[1:D + 1].copy_(w.detach()).requires_grad_()
    b_off = pflat[D + 1:].copy_(b.detach()).requires_grad_()
    assert x_off.data_ptr() % 16 != 0 and w_off.data_ptr() % 16 != 0
    _check_op(op, x_off, w, b, r, PATH_TOL[dtype])
    _check_op(op, x, w_off, b_off, r, PATH_TOL[dtype])
    x_t = x.detach().t().contiguous().t().requires_grad_()  # (rows, D) with strides (1, rows)
    assert not x_t.is_contiguous()
    _check_op(op, x_t, w, b, r, PATH_TOL[dtype])


@pytest.mark.parametrize("device", CUDA_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(9, 1000), (2000, 4096), (3, 100)], ids=["warp", "block", "scalar"])
def test_layer_norm_fp32_params_with_16bit_x(device, dtype, shape):
    """fp32 weight and bias with 16-bit x (the kernels read the parameters as fp32; gradients come back fp32)."""
    x, w, b, _ = _path_inputs(*shape, device, dtype, param_dtype=torch.float32)
    _check_op("layer_norm", x, w, b, None, PATH_TOL[dtype])


@pytest.mark.parametrize("device", CUDA_DEVICES)
@pytest.mark.parametrize("shape", [(15, 96), (2000, 4096), (3, 1001)], ids=["groups", "block", "scalar"])
def test_saved_statistics(device, shape):
    """mean / rstd, one per row, as the backward reads them."""
    x, w, b, _ = _path_inputs(*shape, device, torch.float32)
    x = x.detach()
    _, mean, rstd = torch.ops.hf_zero.layer_norm_fwd(x, w.detach(), b.detach(), 1e-5)
    var, mu = torch.var_mean(x.double(), dim=-1, unbiased=False)
    torch.testing.assert_close(mean.double(), mu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=1e-5, atol=1e-5)
    _, rrstd = torch.ops.hf_zero.rms_norm_fwd(x, w.detach(), 1e-6)
    torch.testing.assert_close(rrstd.double(), torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", CUDA_DEVICES)
def test_weight_gradient_is_deterministic(device):
    """The weight / bias gradients add fixed partial rows in a fixed order: bitwise equal run to run."""
    x, w, b, _ = _path_inputs(2000, 4096, device, torch.bfloat16)
    g = torch.randn_like(x)
    first = torch.autograd.grad(layer_norm(x, w, b, 1e-5), (x, w, b), g)
    second = torch.autograd.grad(layer_norm(x, w, b, 1e-5), (x, w, b), g)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


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
