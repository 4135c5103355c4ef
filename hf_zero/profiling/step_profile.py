"""The ``flops_profiler`` config section, as the engine runs it: profile one optimizer step, report on rank 0.

When ``enabled``, the optimizer step that starts with ``global_steps == profile_step`` (DeepSpeed's rule: the
engine's count of completed steps) is profiled on every rank, every micro-step of it: forward and backward FLOPs
counted at the dispatcher, forward / backward / step latencies, tokens from the attention mask. At the end of that
step rank 0 prints the report (stdout, or ``output_file``). Every other step costs one integer comparison.

After that step the profiler also holds DeepSpeed's read-outs of it (``engine.flops_profiler.flops`` / ``.macs`` /
``.params``, the figures DeepSpeed's profiler keeps after printing): the forward FLOPs and MACs of the step's last
micro-batch -- DeepSpeed restarts its count at every forward, so that is what its ``flops`` holds -- and the model's
parameter count (true sizes; DeepSpeed's is the local shard under ZeRO-3).

Counting changes no numerics and leaves nothing behind: the counter's dispatch mode and module hooks exist only
inside the profiled calls. No collective is issued, so ranks cannot diverge over profiling.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch import nn

from hf_zero.profiling.flops import FlopCounter
from hf_zero.profiling.hardware import device_name, peak_tflops
from hf_zero.profiling.params import count_params
from hf_zero.profiling.profiler import write_profile
from hf_zero.profiling.report import (StepFigures, duration_to_string, format_profile, macs_to_string,
                                     number_to_string, params_to_string)

__all__ = ["StepProfiler", "batch_tokens"]

logger = logging.getLogger("hf_zero")

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def batch_tokens(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(samples, tokens) of one model call: tokens from ``attention_mask`` when given, else ``input_ids``' size."""
    mask = kwargs.get("attention_mask")
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
    first = ids if ids is not None else mask
    if first is None:
        first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    samples = int(first.shape[0]) if first is not None and first.dim() > 0 else 0
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return samples, int(mask.sum().item())
    if ids is not None and not ids.is_floating_point():
        return samples, ids.numel()
    return samples, 0


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepProfiler:
    """Engine side of ``flops_profiler``; see the module docstring. Built once from the typed config section."""

    def __init__(self, module: nn.Module, section, *, rank: int, world_size: int, micro_batch: int,
                 compute_dtype: torch.dtype, device: torch.device):
        self.module = module
        self.enabled = bool(section.enabled)
        self.profile_step = int(section.profile_step)
        self.module_depth = int(section.module_depth)
        self.top_modules = int(section.top_modules)
        self.detailed = bool(section.detailed)
        self.output_file = section.output_file
        self.recompute_fwd_factor = float(section.recompute_fwd_factor)
        self.rank, self.world_size, self.micro_batch = rank, world_size, micro_batch
        self.compute_dtype, self.device = compute_dtype, device
        self._counter: FlopCounter | None = None
        self._seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._samples = self._tokens = self._forwards = 0
        self.report = None                   # the FlopReport of the profiled step, on every rank
        self.figures: StepFigures | None = None
        self.last_report: str | None = None  # the text printed on rank 0
        # DeepSpeed's read-outs of the profiled step (see the module docstring); None until it ran
        self.flops: int | None = None
        self.macs: int | None = None
        self.params: int | None = None
        self.duration: float | None = None   # forward seconds of that last micro-batch
        self._last_forward = (0, 0.0)        # (FLOPs, seconds) of the latest forward window

    def active(self, global_steps: int) -> bool:
        return self.enabled and global_steps == self.profile_step

    @contextmanager
    def _timed(self, phase: str, window: str | None) -> Iterator[None]:
        if self._counter is None:
            self._counter = FlopCounter(self.module, time_modules=True)
        _sync()
        before = self._counter.report.forward
        start = time.perf_counter()
        with self._counter.window(window) if window else nullcontext():
            yield
            _sync()
        seconds = time.perf_counter() - start
        self._seconds[phase] += seconds
        if phase == "forward":
            self._last_forward = (self._counter.report.forward - before, seconds)

    def forward(self, global_steps: int, args: tuple, kwargs: dict):
        if not self.active(global_steps):
            return nullcontext()
        samples, tokens = batch_tokens(args, kwargs)
        self._forwards += 1
        self._samples += samples
        self._tokens += tokens
        return self._timed("forward", "forward")

    def backward(self, global_steps: int):
        return self._timed("backward", "backward") if self.active(global_steps) else nullcontext()

    def step(self, global_steps: int):
        return self._timed("step", None) if self.active(global_steps) else nullcontext()

    def finish_step(self, global_steps: int) -> None:
        """Called at the accumulation boundary, before ``global_steps`` is incremented: report and forget."""
        if not self.active(global_steps) or self._counter is None:
            return
        report, self._counter = self._counter.report, None
        counts = count_params(self.module)
        dtype = _DTYPE_NAMES.get(self.compute_dtype, str(self.compute_dtype))
        figures = StepFigures(
            profile_step=self.profile_step, world_size=self.world_size, dp_size=self.world_size,
            micro_batch=self.micro_batch, micro_steps=self._forwards, params_total=counts.total,
            params_resident=counts.resident_numel, params_resident_bytes=counts.resident_bytes,
            fwd_s=self._seconds["forward"], bwd_s=self._seconds["backward"], step_s=self._seconds["step"],
            samples=self._samples, tokens=self._tokens, peak_tflops=peak_tflops(self.device, self.compute_dtype),
            device=device_name(self.device), dtype=dtype, recompute_fwd_factor=self.recompute_fwd_factor)
        self.report, self.figures = report, figures
        self.flops, self.duration = self._last_forward
        self.macs, self.params = self.flops // 2, counts.total
        if self.rank == 0:
            text, warnings = format_profile(self.module, report, figures, module_depth=self.module_depth,
                                            top_modules=self.top_modules, detailed=self.detailed)
            for w in warnings:
                logger.warning("hf_zero: %s", w)
            write_profile(text, self.output_file)
            self.last_report = text
        self._seconds = dict.fromkeys(self._seconds, 0.0)
        self._samples = self._tokens = self._forwards = 0

    # ---- DeepSpeed's FlopsProfiler getters, answered from the profiled step ------------------------------------
    def _figure(self, value, to_string, as_string: bool):
        if value is None:
            raise RuntimeError(f"flops_profiler: no step profiled yet (flops_profiler.profile_step is "
                               f"{self.profile_step}; its figures are read after that optimizer step)")
        return to_string(value) if as_string else value

    def get_total_flops(self, as_string: bool = False):
        return self._figure(self.flops, number_to_string, as_string)

    def get_total_macs(self, as_string: bool = False):
        return self._figure(self.macs, macs_to_string, as_string)

    def get_total_params(self, as_string: bool = False):
        return self._figure(self.params, params_to_string, as_string)

    def get_total_duration(self, as_string: bool = False):
        return self._figure(self.duration, duration_to_string, as_string)

    def __repr__(self) -> str:
        return f"StepProfiler(enabled={self.enabled}, profile_step={self.profile_step})"

