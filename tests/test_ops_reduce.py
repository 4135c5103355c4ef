"""hf_zero::sum_of_squares against its reference and a float64 ground truth (fp32, bf16, fp16; empty, tiny, odd and
vector-tail sizes, ~1M elements), inf / nan propagation, independence from the thread count, opcheck, and the
fallback path with the compiled ops switched off."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _ops_util import DEVICES, requires_native

from hf_zero.ops.reduce import sum_of_squares, sum_of_squares_reference

REPO = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 0 and 1; below / at / just past one 32-lane group; odd tails past a 2048-element tile and a 65536-element
# block; ~1M, which spans 16 blocks (both threads of a 2-core machine).
SIZES = [0, 1, 7, 31, 32, 33, 1000, 2049, 65535, 65537, 1 << 20, (1 << 20) + 13]
# Both sides accumulate in fp32 (the reference pairwise, the kernel in 32 lanes flushed into double every 64
# terms per lane), so each is within a few fp32 ulps of the exact sum of the fp32-converted squares.
RTOL = 1e-5


def _exact(t: torch.Tensor) -> float:
    return t.double().square().sum().item()


@requires_native
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
def test_matches_reference(device, dtype, numel):
    torch.manual_seed(numel)
    t = (torch.randn(numel, device=device) * 3).to(dtype)
    out = sum_of_squares(t)
    ref = sum_of_squares_reference(t)
    assert out.shape == () and out.dtype == torch.float32 and out.device == t.device
    exact = _exact(t)
    assert out.item() == pytest.approx(exact, rel=RTOL, abs=0.0)
    assert out.item() == pytest.approx(ref.item(), rel=2 * RTOL, abs=0.0)
    if numel == 0:
        assert out.item() == 0.0


@requires_native
@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_multi_dim(device):
    x = torch.randn(64, 33, device=device, dtype=torch.bfloat16)
    for t in (x, x.t(), x[:, ::2]):
        assert sum_of_squares(t).item() == pytest.approx(_exact(t), rel=RTOL)


@requires_native
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad, expected", [(math.inf, math.inf), (-math.inf, math.inf), (math.nan, math.nan)])
@pytest.mark.parametrize("position", [0, 100_000, 100_002])  # first element, mid-array, the 2-element tail
def test_non_finite_propagates(device, dtype, bad, expected, position):
    t = torch.randn(100_003, device=device).to(dtype)
    t[position] = bad
    out = sum_of_squares(t).item()
    assert math.isnan(out) if math.isnan(expected) else out == expected


@requires_native
@pytest.mark.parametrize("device", DEVICES)
def test_inf_and_nan_together_give_nan(device):
    t = torch.randn(5000, device=device, dtype=torch.float16)
    t[10], t[4000] = math.inf, math.nan
    assert math.isnan(sum_of_squares(t).item())


@requires_native
def test_fp32_overflow_of_the_sum_is_inf():
    # each square is finite in fp32 (1e36), their sum (1e39) is not: the reference says inf, so must the kernel
    t = torch.full((1000,), 1e18)
    assert math.isinf(sum_of_squares_reference(t).item())
    assert sum_of_squares(t).item() == math.inf


@requires_native
def test_result_does_not_depend_on_thread_count():
    t = torch.randn((1 << 20) + 5, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sum_of_squares(t).item()
        torch.set_num_threads(max(2, threads))
        many = sum_of_squares(t).item()
    finally:
        torch.set_num_threads(threads)
    assert one == many


@requires_native
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.library.opcheck(torch.ops.hf_zero.sum_of_squares.default, (torch.randn(37, device=device),))
    x = torch.randn(37, device=device, dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.hf_zero.sum_of_squares.default, (x,))


@requires_native
def test_gradient_matches_reference():
    x = torch.randn(300, requires_grad=True)
    (gx,) = torch.autograd.grad(sum_of_squares(x), x)
    torch.testing.assert_close(gx, 2 * x.detach())


def test_other_dtypes_use_the_reference():
    t = torch.randn(100, dtype=torch.float64)
    out = sum_of_squares(t)
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(_exact(t.float()), rel=RTOL)


def test_fallback_when_switched_off():
    code = textwrap.dedent(
        """
        import math, warnings, torch
        from hf_zero.ops._native import native_available
        from hf_zero.ops.reduce import sum_of_squares, sum_of_squares_reference
        assert not native_available("cpu")
        t = torch.randn(10001, dtype=torch.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = sum_of_squares(t)
        assert out.dtype == torch.float32 and out.shape == ()
        assert out.item() == sum_of_squares_reference(t).item()
        assert math.isclose(out.item(), t.double().square().sum().item(), rel_tol=1e-5)
        t[3] = float("inf")
        assert sum_of_squares(t).item() == math.inf
        msgs = [str(w.message) for w in caught if "hf_zero" in str(w.message)]
        assert len(msgs) == 1 and "sum_of_squares" in msgs[0], msgs
        print("OK")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_ZERO_DISABLE_OPS": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
