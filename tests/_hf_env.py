"""Shared pieces of the Hugging Face integration tests (``test_hf_*.py``, ``test_examples_*.py``).

The HF tests run the user's way: real ``torchrun`` / ``accelerate launch`` processes, in an environment where the
real DeepSpeed is *not* installed and ``import deepspeed`` reaches hf_zero through the start-up ``.pth`` line (a
throw-away virtual environment over this interpreter's site-packages, holding a path entry for this checkout and a copy
of ``hf_zero/integrations/hf_zero_deepspeed.pth`` -- what ``pip install`` of hf_zero puts in site-packages).
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from hf_zero.testing import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
INTEGRATIONS = REPO / "integrations"
PTH = REPO / "hf_zero" / "integrations" / "hf_zero_deepspeed.pth"
DISABLE = "HF_ZERO_DISABLE_DEEPSPEED_SHIM"


def make_venv(root: Path, *, with_checkout: bool = True) -> Path:
    """A throw-away virtual environment that imports this interpreter's packages; returns its python.

    The packages come from the *running* interpreter's site-packages, added as plain path entries. Not
    ``--system-site-packages``: inside a virtual environment or conda env that flag reaches the base interpreter,
    which need not have torch (this is how the suite failed when run from a user's venv), and it would also run the
    base site-packages' .pth files, where an hf_zero installed by a developer would shadow the copy under test.
    ``with_checkout``: hf_zero is 'installed' from this checkout -- a path entry plus a copy of the start-up .pth
    line, which is what ``pip install`` of hf_zero puts in site-packages.
    """
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(root)
    python = root / "bin" / "python"
    site_packages = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        ours[site.getusersitepackages()] = None
    # .pth files run in name order: the checkout ("_hf_zero_src") goes ahead of every other package, and both
    # before hf_zero_deepspeed.pth, as an installed hf_zero is importable before its .pth line runs.
    (site_packages / "_hf_zero_test_packages.pth").write_text("".join(f"{p}\n" for p in ours))
    if with_checkout:
        (site_packages / "_hf_zero_src.pth").write_text(f"{REPO}\n")
        shutil.copy(PTH, site_packages / PTH.name)
    return python


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (DISABLE, "PYTHONPATH") and not k.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                        "MASTER_"))}
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run_logged(cmd: list[str], cwd: Path, timeout: int, env: dict[str, str] | None = None) -> str:
    """Run ``cmd``; on failure (or timeout) raise with the tail of its output. Returns the output."""
    try:
        result = subprocess.run(cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-6000:]}") from None
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise AssertionError(f"exit code {result.returncode}: {' '.join(map(str, cmd))}\n{output[-8000:]}")
    return output


def torchrun(python: Path, script: Path, args: list[str], cwd: Path, nproc: int = 2, timeout: int = 240,
             env: dict[str, str] | None = None) -> str:
    cmd = [str(python), "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(script), *args]
    return run_logged(cmd, cwd, timeout, env)


def accelerate_launch(python: Path, config_file: Path, script: Path, args: list[str], cwd: Path,
                      timeout: int = 240, env: dict[str, str] | None = None) -> str:
    cmd = [str(python), "-m", "accelerate.commands.launch", "--config_file", str(config_file), "--main_process_port",
           str(free_port()), str(script), *args]
    return run_logged(cmd, cwd, timeout, env)


def tiny_base_model(path: Path, seed: int = 0, hidden_size: int = 32) -> Path:
    """Save the examples' tiny Llama (fixed seed) as a local 'pretrained' model directory."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from hf_tiny import tiny_llama_config
    finally:
        sys.path.remove(str(EXAMPLES))
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_llama_config(hidden_size)).save_pretrained(path)
    return path


def rel_close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)
