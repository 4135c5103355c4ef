"""``deepspeed.git_version_info``: the build facts ``ds_report``, scripts and DeepSpeed's test utilities read.

DeepSpeed writes this module at install time; here it describes the install that is running: hf_zero's version,
which of DeepSpeed's op names hf_zero's compiled kernels answer (built at install, not JIT), and the torch, CUDA
and NCCL versions this torch was built with (DeepSpeed records ``"0.0"`` for what it could not see; so do we).
"""

from __future__ import annotations

import torch

from hf_zero.comm.accelerator import get_accelerator
from hf_zero.integrations.deepspeed_shim import shim_version
from hf_zero.ops import native_available

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "accelerator_name", "torch_info"]

version = shim_version()
git_hash = "unknown"
git_branch = "unknown"
accelerator_name = get_accelerator().device_name()
# DeepSpeed's op name -> built and loadable; hf_zero's CPU kernels answer the CPU optimizers, its CUDA kernels FusedAdam
installed_ops = {
    "cpu_adam": native_available("cpu"), "cpu_adagrad": native_available("cpu"), "cpu_lion": native_available("cpu"),
    "fused_adam": torch.cuda.is_available() and native_available("cuda"),
}


def _nccl_version() -> str:
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "nccl"):
        return "0.0"
    major, minor = torch.cuda.nccl.version()[:2]
    return f"{major}.{minor}"


torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    "cuda_version": torch.version.cuda or "0.0",
    "nccl_version": _nccl_version(),
    "hip_version": getattr(torch.version, "hip", None) or "0.0",
}
