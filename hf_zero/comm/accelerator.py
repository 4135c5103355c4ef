"""The device this process computes on, answered the way DeepSpeed's ``get_accelerator()`` answers it.

transformers calls ``get_accelerator().current_device_name()`` (where to put broadcast buffers under ZeRO-3) and
``device_name(local_rank)``; ``deepspeed.accelerator.get_accelerator`` forwards here. The device is CUDA when this
process sees a GPU, else CPU -- the same rule as :func:`hf_zero.comm.default_backend`, so the device and the
communication backend always agree (cuda/nccl or cpu/gloo).
"""

from __future__ import annotations

import functools

import torch

from .process_group import default_backend, get_local_rank

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """DeepSpeed's accelerator interface, the part HF code and training scripts use."""

    def __init__(self, device_type: str):
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"hf_zero: unsupported accelerator device type {device_type!r}; expected 'cuda' or 'cpu'")
        self._name = device_type  # DeepSpeed's attribute name, read by some scripts

    def device_name(self, device_index: int | str | None = None) -> str:
        """``'cuda'`` / ``'cuda:<i>'``; always ``'cpu'`` on CPU (DeepSpeed's CPU accelerator ignores the index)."""
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"{self._name}:{int(device_index)}"

    def current_device(self) -> int:
        """CUDA's current device index; on CPU, the local rank (as DeepSpeed's CPU accelerator answers)."""
        return torch.cuda.current_device() if self._name == "cuda" else get_local_rank()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._name == "cuda" else True

    def communication_backend_name(self) -> str:
        return default_backend()

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"


@functools.cache
def get_accelerator() -> Accelerator:
    """The process's accelerator (decided once, like DeepSpeed's)."""
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")
