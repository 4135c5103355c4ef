"""``deepspeed.runtime.fp16.loss_scaler``: DeepSpeed's loss-scaler classes and config-key constants.

Why they exist in hf_zero: scripts import them for two things. Most often, to allow DeepSpeed's pickled checkpoint
objects under ``torch.load(weights_only=True)`` (torch >= 2.6)::

    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum])

``add_safe_globals`` allows a class under its ``__module__.__qualname__``; DeepSpeed's files name
``deepspeed.runtime.fp16.loss_scaler.LossScaler``, so these classes carry that module name (and the shim module of
that name forwards to them): the script's allow-list then admits exactly what DeepSpeed's files hold, and the
loaded objects are these classes with the pickled attributes. Less often, a script drives a scaler by hand
(Megatron-style ``scale_loss`` / ``update_scale``); these do what DeepSpeed's do: a static scale, or a dynamic one
that halves on overflow after ``delayed_shift`` overflows (hysteresis) and doubles after ``scale_window`` clean
steps. hf_zero's engine uses its own scaler (:class:`hf_zero.zero.loss_scaler.LossScaler`), with the same rule.
"""

from __future__ import annotations

import json
import logging

import torch

from hf_zero.integrations.compat import logger

__all__ = ["INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT", "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE",
           "LossScalerBase", "LossScaler", "DynamicLossScaler", "CreateLossScaler"]

# the keys of DeepSpeed's dynamic_loss_args
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"

_DS_MODULE = "deepspeed.runtime.fp16.loss_scaler"  # the name DeepSpeed's checkpoints pickle these classes under


def _has_inf_or_nan(t: torch.Tensor) -> bool:
    return not bool(torch.isfinite(t.float()).all())


class LossScalerBase:
    """A loss scale ``cur_scale``; ``dynamic`` says whether it moves."""

    def __init__(self, cur_scale):
        self.cur_scale = cur_scale
        self.dynamic = False

    @property
    def loss_scale(self):
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def scale_loss(self, loss):
        return loss * self.loss_scale

    def backward(self, loss, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            logger.warning("hf_zero: overflow: gradients are not finite; the step is skipped")

    def __repr__(self) -> str:  # as DeepSpeed prints its config objects: the attributes as JSON
        return json.dumps({k: v for k, v in vars(self).items() if isinstance(v, (int, float, bool, str))},
                          indent=4)


class LossScaler(LossScalerBase):
    """A static loss scale (``scale``): never overflows by its own account."""

    def __init__(self, scale=1):
        super().__init__(scale)

    def has_overflow(self, params) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic loss scale: on an overflow the scale halves (not below ``min_scale``) once
    ``delayed_shift`` overflows have been seen since the last clean window (hysteresis); after ``scale_window``
    clean steps since the last overflow it doubles. ``consecutive_hysteresis`` refills the hysteresis on every
    clean step. At ``min_scale`` with ``raise_error_at_min_scale`` an overflow is an error (training cannot go on)."""

    def __init__(self, init_scale=2 ** 32, scale_window=1000, min_scale=1, delayed_shift=1,
                 consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.half):
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.dynamic = True
        self.dtype = dtype

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and _has_inf_or_nan(p.grad) for p in params)

    has_overflow = has_overflow_serial

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError(f"hf_zero: the loss scale is at its minimum ({self.min_scale}) and the "
                                       f"gradients still overflow; training cannot continue")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            logger.log(logging.INFO, "hf_zero: overflow: step skipped, loss scale %s, hysteresis %s",
                       self.cur_scale, self.cur_hysteresis)
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            clean = self.cur_iter - self.last_overflow_iter - 1  # clean steps since the last overflow
            if clean > 0 and clean % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def CreateLossScaler(dtype, static_loss_scale, dynamic_scaling, dynamic_loss_args):  # noqa: N802 (DeepSpeed's name)
    """fp16 with dynamic scaling: a :class:`DynamicLossScaler` from ``dynamic_loss_args``; else a static
    :class:`LossScaler` (``static_loss_scale`` under fp16, 1.0 otherwise)."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("hf_zero: CreateLossScaler: dynamic scaling needs dynamic_loss_args")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)


for _cls in (LossScalerBase, LossScaler, DynamicLossScaler):
    _cls.__module__ = _DS_MODULE
