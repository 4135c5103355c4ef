"""`hf-zero doctor` / `python -m hf_zero doctor` prints the state of the installation on one screen."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from _ops_util import requires_native

from hf_zero.cli import main

REPO = Path(__file__).resolve().parents[1]


def _doctor(**env: str) -> str:
    result = subprocess.run([sys.executable, "-m", "hf_zero", "doctor"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@requires_native
def test_doctor_reports_stack_ops_backends_and_deepspeed_layer():
    out = _doctor()
    assert len(out.splitlines()) < 60, "doctor must fit one screen"
    for section in ("Versions", "Compiled ops", "Distributed", "deepspeed compatibility layer", "Threads"):
        assert section in out
    assert f"torch         {torch.__version__}" in out
    for package in ("transformers", "accelerate", "peft", "safetensors", "bitsandbytes"):
        assert f"  {package}" in out
    assert "hf_zero._C       loaded" in out
    assert "adam_step                yes" in out
    assert "smoke test (scale_add on CPU): ok" in out
    assert "gloo yes" in out
    assert f"CUDA devices  {torch.cuda.device_count()}" in out
    assert "import deepspeed -> " in out
    assert "deepspeed command  " in out
    assert f"torch intra-op" in out


def test_doctor_explains_switched_off_ops_and_shim():
    out = _doctor(HF_ZERO_DISABLE_OPS="1", HF_ZERO_DISABLE_DEEPSPEED_SHIM="1")
    assert "hf_zero._C       not loaded: switched off by HF_ZERO_DISABLE_OPS=1" in out
    assert "every op runs its pure-PyTorch reference" in out
    assert "HF_ZERO_DISABLE_DEEPSPEED_SHIM=1" in out


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().out
