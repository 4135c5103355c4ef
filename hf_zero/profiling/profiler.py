"""DeepSpeed's profiler API over hf_zero's dispatcher count: ``FlopsProfiler`` and ``get_model_profile``.

Same names, signatures and return values as ``deepspeed.profiling.flops_profiler``; what differs is how the
figures are obtained: FLOPs are counted at the dispatcher (exact under ZeRO-3, attention and operator arithmetic
included, nothing patched), and parameters are the true sizes under every stage. Like DeepSpeed's, the profiler
measures the forward passes run between ``start_profile`` and ``stop_profile``; a backward run in that interval is
counted separately (:attr:`FlopsProfiler.report`) and not added to ``get_total_flops``.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import ExitStack

import torch
from torch import nn

from hf_zero.profiling.flops import FlopCounter, FlopReport
from hf_zero.profiling.params import count_params
from hf_zero.profiling.report import (StepFigures, duration_to_string, format_profile, macs_to_string,
                                      number_to_string, params_to_string)

__all__ = ["FlopsProfiler", "get_model_profile"]

logger = logging.getLogger("hf_zero")


class FlopsProfiler:
    """Profile the forward passes of ``model`` between :meth:`start_profile` and :meth:`stop_profile`.

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(batch)
        flops = prof.get_total_flops()
        prof.print_model_profile(profile_step=1)
        prof.end_profile()
    """

    def __init__(self, model: nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._counter: FlopCounter | None = None
        self._stack: ExitStack | None = None

    @property
    def report(self) -> FlopReport:
        return self._counter.report if self._counter is not None else FlopReport()

    def start_profile(self, ignore_list=None) -> None:
        """Start counting. ``ignore_list`` (module types DeepSpeed would skip) is refused: a dispatcher count
        cannot leave a module's operations out without losing them from its parents too."""
        if ignore_list:
            raise ValueError("hf_zero FlopsProfiler.start_profile(ignore_list=...): ignoring module types is not "
                             "supported (FLOPs are counted at the dispatcher, every op once); pass None")
        self.reset_profile()
        self._counter = FlopCounter(self.model, time_modules=True)
        self._stack = ExitStack()
        self._stack.enter_context(self._counter.window("auto"))
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the figures stay readable until :meth:`end_profile`."""
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def reset_profile(self) -> None:
        self.stop_profile()
        self._counter = None

    def end_profile(self) -> None:
        """Stop counting and drop the figures (every hook is already gone after :meth:`stop_profile`)."""
        self.reset_profile()
        self.started = False

    def get_total_flops(self, as_string: bool = False):
        flops = self.report.forward
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        macs = self.report.forward // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False):
        name = type(self.model).__name__
        seconds = self.report.module_seconds.get(name, 0.0)
        return duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string: bool = False):
        """The model's parameters, true sizes (DeepSpeed reports the local shard under ZeRO-3)."""
        params = count_params(self.model).total
        return params_to_string(params) if as_string else params

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        if not self.started:
            return
        counts = count_params(self.model)
        # the figures DeepSpeed's profiler keeps after printing (scripts read prof.flops after the print)
        self.flops, self.macs, self.params = self.get_total_flops(), self.get_total_macs(), counts.total
        engine = self.ds_engine
        figures = StepFigures(profile_step=profile_step, params_total=counts.total,
                              params_resident=counts.resident_numel, params_resident_bytes=counts.resident_bytes,
                              fwd_s=self.get_total_duration() or None, recompute_fwd_factor=self.recompute_fwd_factor)
        if engine is not None:
            figures.world_size = figures.dp_size = int(getattr(engine, "world_size", 1))
            figures.micro_batch = engine.train_micro_batch_size_per_gpu()
        text, warnings = format_profile(self.model, self.report, figures, module_depth=module_depth,
                                        top_modules=top_modules, detailed=detailed)
        for w in warnings:
            logger.warning("hf_zero: %s", w)
        write_profile(text, output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        figures = StepFigures(profile_step=0, params_total=count_params(self.model).total)
        text, _ = format_profile(self.model, self.report, figures, module_depth=module_depth,
                                 top_modules=top_modules, detailed=False)
        print(text[text.index("Top "):])


def write_profile(text: str, output_file: str | None) -> None:
    """Print ``text``, or write it to ``output_file`` (its directory is created)."""
    if not output_file:
        print(text, file=sys.stdout, flush=True)
        return
    directory = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(directory, exist_ok=True)
    with open(output_file, "w") as f:
        f.write(text + "\n")


def get_model_profile(model: nn.Module, input_shape=None, args=[], kwargs={}, print_profile: bool = True,  # noqa: B006
                      detailed: bool = True, module_depth: int = -1, top_modules: int = 1, warm_up: int = 1,
                      as_string: bool = True, output_file: str | None = None, ignore_modules=None,
                      mode: str = "forward"):
    """FLOPs, MACs and parameters of one forward (``mode="forward"``) or ``generate`` call of ``model``.

    Returns ``(flops, macs, params)``, as DeepSpeed-formatted strings when ``as_string``. ``input_shape`` builds one
    positional input tensor of that shape in the model's dtype, as DeepSpeed does.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    model.eval()
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        args = [torch.empty(input_shape, dtype=first.dtype if first is not None else torch.float32,
                            device=first.device if first is not None else "cpu").normal_()]
    if not args and not kwargs:
        raise ValueError("get_model_profile: pass input_shape, args or kwargs (the model's inputs)")
    call = model.generate if mode == "generate" else model
    for _ in range(warm_up):
        call(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        call(*args, **kwargs)
    finally:
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
