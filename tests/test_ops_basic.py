"""hf_zero::scale_add end to end (compiled kernel, fake kernel, autograd, opcheck) and the fallback path."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _ops_util import DEVICES, requires_native

from hf_zero.ops.scale_add import scale_add, scale_add_reference

REPO = Path(__file__).resolve().parents[1]


@requires_native
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_add_matches_reference(device, dtype):
    x = torch.randn(3, 1000, device=device, dtype=dtype, requires_grad=True)
    y = torch.randn(3, 1000, device=device, dtype=dtype, requires_grad=True)
    out = scale_add(x, y, 0.5)
    ref = scale_add_reference(x, y, 0.5)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    gx, gy = torch.autograd.grad(out, (x, y), grad)
    rx, ry = torch.autograd.grad(ref, (x, y), grad)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gy, ry)


@requires_native
@pytest.mark.parametrize("device", DEVICES)
def test_scale_add_opcheck(device):
    x = torch.randn(4, 7, device=device, requires_grad=True)
    y = torch.randn(4, 7, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.hf_zero.scale_add.default, (x, y, 2.0))


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_fallback_when_switched_off_warns_once_and_matches_reference():
    result = _run_python(
        """
        import warnings, torch
        from hf_zero.ops._native import native_available, extension_status
        from hf_zero.ops.scale_add import scale_add
        from hf_zero.ops.adam import adam_step_
        assert not native_available("cpu")
        assert "HF_ZERO_DISABLE_OPS" in extension_status("cpu").reason
        x, y = torch.randn(10), torch.randn(10)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = scale_add(x, y, 3.0)
            scale_add(x, y, 3.0)
            p = torch.zeros(4); m = torch.zeros(4); v = torch.zeros(4)
            adam_step_(p, torch.ones(4), m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, adamw_mode=True, bias_correction=True)
        torch.testing.assert_close(out, x + 3.0 * y)
        torch.testing.assert_close(p, torch.full((4,), -0.1))
        msgs = [str(w.message) for w in caught if "hf_zero" in str(w.message)]
        assert len(msgs) == 1, msgs
        assert "switched off by HF_ZERO_DISABLE_OPS" in msgs[0] and "pip install" in msgs[0], msgs[0]
        print("OK")
        """,
        HF_ZERO_DISABLE_OPS="1",
    )
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_not_built_reason_is_reported():
    # Hide the compiled module the way a failed/skipped build would: a meta-path finder that refuses it.
    result = _run_python(
        """
        import sys, importlib.abc
        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "hf_zero._C":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None
        sys.meta_path.insert(0, Hide())
        from hf_zero.ops._native import extension_status
        print(extension_status("cpu").reason)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "not built" in result.stdout
