"""Dense peak FLOP/s per accelerator and compute dtype: the denominator of MFU.

Figures are the vendors' dense numbers (never the 2:4-sparsity ones, which would halve every MFU), in TFLOP/s.
fp32 matmuls use TF32 tensor cores only when ``torch.backends.cuda.matmul.allow_tf32`` is on, so fp32 resolves to
the TF32 column then, else to the plain fp32 one. On a device not in the table the peak is unknown and callers
report no MFU rather than a guess; ``HF_ZERO_PEAK_TFLOPS`` (or an explicit argument) supplies it.
"""

from __future__ import annotations

import os

import torch

__all__ = ["PEAK_TFLOPS", "PEAK_ENV", "peak_tflops", "device_name"]

PEAK_ENV = "HF_ZERO_PEAK_TFLOPS"

# device-name substring (lower case, most specific first) -> {dtype column: dense TFLOP/s}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "gh200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h100 nvl": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "h100 pcie": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "h100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},       # SXM
    "h800": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "a800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "l40s": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "a10g": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "a10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "v100": {"fp16": 125.0, "fp32": 15.7},
    "t4": {"fp16": 65.0, "fp32": 8.1},
    "mi300x": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "mi250x": {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7},
}

_DTYPE_COLUMN = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def device_name(device: torch.device | str | None = None) -> str:
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return "cpu" if device is None or device.type == "cpu" else device.type


def peak_tflops(device: torch.device | str | None, dtype: torch.dtype, override: float | None = None) -> float | None:
    """Dense peak TFLOP/s of one ``device`` computing in ``dtype``; None when unknown.

    ``override`` (e.g. ``HfZeroCallback(peak_tflops=...)``) wins, then ``HF_ZERO_PEAK_TFLOPS``, then the table.
    """
    if override is not None:
        return float(override)
    env = os.environ.get(PEAK_ENV, "").strip()
    if env:
        try:
            return float(env)
        except ValueError:
            raise ValueError(f"{PEAK_ENV}={env!r} is not a number; set it to the dense peak TFLOP/s of one "
                             f"device (e.g. 989.4 for an H100 SXM in bf16) or unset it") from None
    name = device_name(device).lower()
    column = _DTYPE_COLUMN.get(dtype)
    if column == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        column = "tf32"
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(column)
    return None
