"""The engine's step-time roofline, recalibrated from its own first measured steps.

The engine times every optimizer step from boundary to boundary (the first from the first forward) and notes the
``(batch, seq)`` shape of each forward. After ``warmup`` steps (allocator, gather traces and caches settle) it
measures ``steps`` more, then fits the roofline's compute efficiency so that its step time equals their median
(:meth:`StepTimeModel.calibrate`). From then on ``step_time_model`` is a roofline of *this* hardware:
``predicted_step_s`` is its figure for the calibration steps' workload, and :meth:`predict` gives other shapes,
stages or world sizes through ``StepTimeModel.breakdown``.

FLOPs come from :func:`hf_zero.profiling.analytic.analytic_flops` on the model's config, so the calibration exists
for the families it knows (decoder LMs, GPT-2, BERT-style encoders); for others ``step_time_model`` stays None.
After calibration every call is one branch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.profiling.analytic import analytic_flops, supports
from hf_zero.profiling.hardware import peak_tflops
from hf_zero.profiling.steptime import Hardware, StepTimeModel

__all__ = ["StepTimeCalibrator", "CalibratedStepTime"]

logger = logging.getLogger("hf_zero")


@dataclass(frozen=True)
class CalibratedStepTime:
    """A roofline fitted to measured steps, with the workload it was fitted on."""

    model: StepTimeModel
    workload: dict
    measured_s: tuple[float, ...]

    @property
    def predicted_step_s(self) -> float:
        return self.model.breakdown(**self.workload)["step"]

    def predict(self, **changes: Any) -> dict[str, float]:
        """The roofline's split for the calibration workload with ``changes`` (e.g. ``model_flops_per_rank``,
        ``stage``, ``world_size``, ``offload_optimizer``)."""
        return self.model.breakdown(**{**self.workload, **changes})


class StepTimeCalibrator:
    """Engine side; see the module docstring."""

    def __init__(self, module: torch.nn.Module, *, stage: int, world_size: int, compute_dtype: torch.dtype,
                 device: torch.device, offload_optimizer: str, warmup: int = 1, steps: int = 2):
        self.config = getattr(module, "config", None)
        self.enabled = self.config is not None and supports(self.config)
        self.module = module
        self.stage, self.world_size, self.offload_optimizer = stage, world_size, offload_optimizer
        self.compute_dtype, self.device = compute_dtype, device
        self.warmup, self.steps = warmup, steps
        self._start: float | None = None
        self._shapes: list[tuple[int, int]] = []   # (batch, seq) of each forward of the current step
        self._measured: list[float] = []
        self._workloads: list[float] = []          # model FLOPs of each measured step
        self._seen = 0
        self.result: CalibratedStepTime | None = None

    def forward(self, args: tuple, kwargs: dict) -> None:
        if not self.enabled or not torch.is_grad_enabled():
            return
        if self._start is None:
            self._start = time.perf_counter()
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            self._shapes.append((int(ids.shape[0]), int(ids.shape[1])))

    def boundary(self) -> None:
        """An optimizer step ended."""
        if not self.enabled or self._start is None:
            return
        now = time.perf_counter()
        elapsed, shapes = now - self._start, self._shapes
        self._start, self._shapes = now, []
        self._seen += 1
        if self._seen <= self.warmup or not shapes:
            return
        self._measured.append(elapsed)
        self._workloads.append(float(sum(analytic_flops(self.config, b, s).training for b, s in shapes)))
        if len(self._measured) >= self.steps:
            self._calibrate()

    def _calibrate(self) -> None:
        from hf_zero.profiling.params import count_params

        counts = count_params(self.module)
        ordered = sorted(self._workloads)
        workload = dict(model_flops_per_rank=ordered[len(ordered) // 2], params=counts.total,
                        trainable=counts.trainable, stage=self.stage, world_size=self.world_size,
                        param_bytes=torch.empty(0, dtype=self.compute_dtype).element_size(),
                        offload_optimizer=self.offload_optimizer)
        # an unknown device gets a nominal 1 TFLOP/s: the fitted efficiency then reads as achieved TFLOP/s
        peak = peak_tflops(self.device, self.compute_dtype) or 1.0
        fitted = StepTimeModel(Hardware(peak_tflops=peak)).calibrate(self._measured, **workload)
        self.result = CalibratedStepTime(fitted, workload, tuple(self._measured))
        self.enabled = False
        # debug, not info: a diagnostic of engine.step_time_model (hf-zero estimate's step-time predictions), not
        # something a training run's user has to read or act on
        share = (f" ({100 * fitted.efficiency:.1f}% of the device's {peak:g} TFLOP/s peak)"
                 if peak_tflops(self.device, self.compute_dtype) else "")
        logger.debug("hf_zero: step-time model fitted on the first %d steps: this run computes at %.3g TFLOP/s per "
                     "process%s; a step is predicted to take %.3f s (engine.step_time_model, used by hf-zero "
                     "estimate)", len(self._measured), fitted.efficiency * peak, share, self.result.predicted_step_s)
