"""The one place that loads hf_zero's compiled extensions and remembers what happened.

``hf_zero._C`` (CPU kernels, plus the schemas of every ``torch.ops.hf_zero`` op) and ``hf_zero._C_cuda`` (CUDA
kernels) are compiled at install time (see setup.py). Loading is lazy and never raises: when an extension is
missing, switched off or fails to load, ``native_available(device)`` is False, the op wrappers in hf_zero.ops run
their pure-PyTorch references, and the first such use emits a single warning that says why and how to rebuild.

``HF_ZERO_DISABLE_OPS=1`` makes the loader ignore the compiled extensions (tests use it to prove the fallback).
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from dataclasses import dataclass

import torch

__all__ = ["DISABLE_ENV", "ExtensionStatus", "extension_status", "native_available", "op_kernels", "warn_fallback",
           "stale_build_warning"]

DISABLE_ENV = "HF_ZERO_DISABLE_OPS"
REBUILD_HINT = "rebuild with `pip install --no-build-isolation -e .` in the hf_zero checkout (see `hf-zero doctor`)"

# device type -> extension module providing its kernels
_MODULES = {"cpu": "hf_zero._C", "cuda": "hf_zero._C_cuda"}


@dataclass(frozen=True)
class ExtensionStatus:
    module: str
    loaded: bool
    reason: str  # why not loaded ("" when loaded)


_lock = threading.Lock()
_status: dict[str, ExtensionStatus] = {}
_warned = False


def _load(device_type: str) -> ExtensionStatus:
    module = _MODULES[device_type]
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return ExtensionStatus(module, False, f"switched off by {DISABLE_ENV}={os.environ[DISABLE_ENV]}")
    if device_type == "cuda":
        # The CUDA kernels register into the schemas that hf_zero._C defines.
        cpu = extension_status("cpu")
        if not cpu.loaded:
            return ExtensionStatus(module, False, f"needs hf_zero._C, which is not loaded ({cpu.reason})")
        if torch.version.cuda is None:
            return ExtensionStatus(module, False, "the installed torch has no CUDA support")
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return ExtensionStatus(module, False, "not built (installed with HF_ZERO_BUILD_OPS=0, or the "
                                                  "compilation failed at install time)")
        return ExtensionStatus(module, False, f"load error: {exc}")
    except (ImportError, OSError, RuntimeError) as exc:  # undefined symbol, ABI mismatch, missing libcudart...
        return ExtensionStatus(module, False, f"load error: {exc}")
    return ExtensionStatus(module, True, "")


def extension_status(device_type: str) -> ExtensionStatus:
    """Load (once) and report the extension that holds the kernels for ``device_type`` ("cpu" or "cuda")."""
    if device_type not in _MODULES:
        return ExtensionStatus("", False, f"hf_zero has no compiled kernels for device type {device_type!r}")
    status = _status.get(device_type)
    if status is None:
        with _lock:
            status = _status.get(device_type)
            if status is None:
                status = _status[device_type] = _load(device_type)
    return status


def native_available(device: str | torch.device = "cpu") -> bool:
    """True when compiled hf_zero kernels can run on ``device``. "meta" asks whether the schemas exist."""
    device_type = torch.device(device).type
    if device_type == "meta":
        device_type = "cpu"
    return extension_status(device_type).loaded


def warn_fallback(op_name: str, device: str | torch.device) -> None:
    """Warn once per process that ``op_name`` (and every later op) runs its pure-PyTorch reference."""
    global _warned
    if _warned:
        return
    _warned = True
    status = extension_status(torch.device(device).type)
    warnings.warn(
        f"hf_zero: compiled kernels unavailable on {torch.device(device).type} ({status.module or 'none'}: "
        f"{status.reason}); `hf_zero::{op_name}` and the other hf_zero ops use their pure-PyTorch references, "
        f"which are slower. To get the compiled kernels, {REBUILD_HINT}.",
        RuntimeWarning,
        stacklevel=3,
    )


_stale_warned: set[str] = set()


def stale_build_warning(op_name: str) -> None:
    """Warn once per op that the loaded extension predates ``op_name`` (its reference runs instead)."""
    if op_name in _stale_warned:
        return
    _stale_warned.add(op_name)
    warnings.warn(f"hf_zero: the compiled extension {_MODULES['cpu']} was built before `hf_zero::{op_name}` "
                  f"existed; its pure-PyTorch reference runs instead. To get the kernel, {REBUILD_HINT}.",
                  RuntimeWarning, stacklevel=3)


def op_kernels() -> dict[str, list[str]]:
    """``{op name: [dispatch keys with a compiled kernel]}`` for every ``hf_zero::`` op (empty when not loaded)."""
    if not extension_status("cpu").loaded:
        return {}
    if torch.version.cuda is not None:
        extension_status("cuda")
    names = sorted(
        str(schema.name).split("::", 1)[1]
        for schema in torch._C._jit_get_all_schemas()
        if str(schema.name).startswith("hf_zero::")
    )
    return {
        name: [key for key in ("CPU", "CUDA") if torch._C._dispatch_has_kernel_for_dispatch_key(f"hf_zero::{name}", key)]
        for name in names
    }
