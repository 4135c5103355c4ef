"""Helpers shared by the tests of hf_zero.ops: which devices have compiled kernels, and a skip marker."""

from __future__ import annotations

import pytest
import torch

from hf_zero.ops._native import extension_status, native_available

requires_native = pytest.mark.skipif(
    not native_available("cpu"), reason=f"hf_zero._C not loaded: {extension_status('cpu').reason}"
)


def native_devices() -> list[str]:
    """Devices whose compiled kernels can run here ("cuda" only with a GPU and hf_zero._C_cuda)."""
    devices = ["cpu"] if native_available("cpu") else []
    if torch.cuda.is_available() and native_available("cuda"):
        devices.append("cuda")
    return devices


DEVICES = native_devices() or ["cpu"]
