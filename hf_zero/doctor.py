"""``hf-zero doctor``: one screen that says what this installation can do and why not.

Versions of the stack, which compiled ops are built and loaded (and the reason when they are not), the
distributed backends, CUDA devices, whether ``import deepspeed`` reaches hf_zero's compatibility layer or a real
DeepSpeed, and the thread settings. It imports nothing heavy beyond torch and never imports ``deepspeed``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hf_zero.integrations.deepspeed_shim import DISABLE_ENV as SHIM_DISABLE_ENV
from hf_zero.integrations.deepspeed_shim import disabled as shim_disabled

__all__ = ["Report", "collect", "main", "render"]

PACKAGES = ("torch", "transformers", "accelerate", "peft", "safetensors", "bitsandbytes")
PTH_NAME = "hf_zero_deepspeed.pth"


@dataclass
class Report:
    versions: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, tuple[bool, str]] = field(default_factory=dict)  # module -> (loaded, reason)
    op_kernels: dict[str, list[str]] = field(default_factory=dict)  # op -> dispatch keys with a compiled kernel
    smoke_test: str = ""
    backends: dict[str, bool] = field(default_factory=dict)
    cuda_devices: list[str] = field(default_factory=list)
    deepspeed: str = ""
    deepspeed_pth: list[str] = field(default_factory=list)
    deepspeed_command: str = ""
    shim_env: str = ""
    threads: str = ""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _deepspeed_resolution() -> str:
    """Where ``import deepspeed`` would go, without importing it."""
    import hf_zero

    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError) as exc:
        return f"lookup failed ({exc})"
    if spec is None or spec.origin in (None, "namespace"):
        shim_off = shim_disabled()
        return "not importable" + (f" (compatibility layer switched off by {SHIM_DISABLE_ENV})" if shim_off else
                                   f" (compatibility layer not active: is {PTH_NAME} in site-packages?)")
    origin = Path(spec.origin).resolve()
    hf_zero_root = Path(hf_zero.__file__).resolve().parent
    if hf_zero_root in origin.parents:
        return f"hf_zero compatibility layer ({origin.parent})"
    return f"real DeepSpeed {_version('deepspeed')} ({origin.parent}); hf_zero's layer stands aside"


def _deepspeed_command() -> str:
    """Which ``deepspeed`` command is on PATH and what it runs (hf-zero's defers to a real DeepSpeed's runner)."""
    import shutil

    path = shutil.which("deepspeed")
    if path is None:
        return "not on PATH (use `hf-zero launch` or `python -m deepspeed.launcher.runner`)"
    try:
        with open(path, errors="replace") as f:
            text = f.read(4096)
    except OSError as exc:
        return f"{path} (unreadable: {exc})"
    if "hf_zero.integrations.deepspeed_command" in text:
        return f"{path}: hf-zero's (runs a real DeepSpeed's launcher if one is installed, else hf_zero's)"
    if "deepspeed.launcher.runner" in text:
        return f"{path}: DeepSpeed's own script"
    return f"{path}: unknown script"


def _installed_pth_files() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user_site = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if user_site:
        dirs.append(user_site)
    return [str(Path(d, PTH_NAME)) for d in dirs if Path(d, PTH_NAME).is_file()]


def _smoke_test() -> str:
    import torch

    from hf_zero.ops import native_available
    from hf_zero.ops.scale_add import scale_add_reference

    if not native_available("cpu"):
        return "skipped (no compiled CPU ops)"
    x, y = torch.arange(8.0), torch.ones(8)
    try:
        out = torch.ops.hf_zero.scale_add(x, y, 2.0)
    except Exception as exc:  # a loaded library whose kernel crashes is exactly what doctor is for
        return f"FAILED: {type(exc).__name__}: {exc}"
    return "ok" if torch.equal(out, scale_add_reference(x, y, 2.0)) else "FAILED: wrong result"


def collect() -> Report:
    import torch
    import torch.distributed as dist

    from hf_zero import __version__
    from hf_zero.ops import extension_status, op_kernels

    report = Report()
    report.versions["hf_zero"] = __version__
    report.versions["python"] = f"{platform.python_version()} ({sys.executable})"
    for name in PACKAGES:
        report.versions[name] = _version(name)
    report.versions["torch"] += f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)"

    for device_type in ("cpu", "cuda"):
        status = extension_status(device_type)
        report.extensions[status.module] = (status.loaded, status.reason)
    report.op_kernels = op_kernels()
    report.smoke_test = _smoke_test()

    report.backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    if torch.cuda.is_available():
        report.cuda_devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]

    report.deepspeed = _deepspeed_resolution()
    report.deepspeed_pth = _installed_pth_files()
    report.deepspeed_command = _deepspeed_command()
    report.shim_env = os.environ.get(SHIM_DISABLE_ENV, "")
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    report.threads = f"torch intra-op {torch.get_num_threads()}, OMP_NUM_THREADS={omp}, CPUs {os.cpu_count()}"
    return report


def render(report: Report) -> str:
    lines = ["hf_zero doctor", "", "Versions"]
    lines += [f"  {name:<13} {value}" for name, value in report.versions.items()]

    lines += ["", "Compiled ops"]
    for module, (loaded, reason) in report.extensions.items():
        lines.append(f"  {module:<16} {'loaded' if loaded else 'not loaded: ' + reason}")
    if report.op_kernels:
        lines.append(f"  {'op':<24} CPU  CUDA")
        for op, keys in report.op_kernels.items():
            lines.append(f"  {op:<24} {'yes' if 'CPU' in keys else '-':<4} {'yes' if 'CUDA' in keys else '-'}")
    else:
        lines.append("  no compiled ops: every op runs its pure-PyTorch reference (slower). Rebuild with "
                     "`pip install --no-build-isolation -e .`")
    lines.append(f"  smoke test (scale_add on CPU): {report.smoke_test}")

    lines += ["", "Distributed"]
    lines.append("  backends      " + ", ".join(f"{b} {'yes' if ok else 'no'}" for b, ok in report.backends.items()))
    lines.append(f"  CUDA devices  {len(report.cuda_devices)}" +
                 (f" ({', '.join(report.cuda_devices)})" if report.cuda_devices else ""))

    lines += ["", "deepspeed compatibility layer"]
    lines.append(f"  import deepspeed -> {report.deepspeed}")
    lines.append(f"  startup hook  {', '.join(report.deepspeed_pth) if report.deepspeed_pth else PTH_NAME + ' not found'}")
    lines.append(f"  {SHIM_DISABLE_ENV}={report.shim_env or '(unset)'}")
    lines.append(f"  deepspeed command  {report.deepspeed_command}")

    lines += ["", "Threads", f"  {report.threads}"]
    return "\n".join(lines)


def main() -> int:
    print(render(collect()))
    return 0
