"""Tokens, model FLOPs and hardware FLOPs of the micro-batches a Trainer runs, for ``HfZeroCallback``'s MFU logs.

A forward pre-hook on the module the Trainer calls (the engine) sees every training micro-batch (grad mode on;
evaluation runs without grad and is not counted):

- **tokens**: ``attention_mask.sum()`` when the batch has a mask, else ``input_ids.numel()``;
- **model FLOPs**: :func:`hf_zero.profiling.analytic_flops` for the padded ``batch x seq`` shape (padding is
  computed too) when the model's family is supported;
- **hardware FLOPs**: model FLOPs times the hardware/model ratio *counted* at the dispatcher on the first training
  micro-batch (its forward, backward and optimizer step run inside one :class:`~hf_zero.profiling.FlopCounter`
  window: activation-checkpoint and flash-attention recompute are seen, not assumed). That count also checks the
  analytic figure: beyond 2% apart, a warning names both and the counted figure, scaled by padded tokens, is used.
  A model under ``torch.compile`` runs that micro-batch eagerly (see ``FlopCounter.window``) and is compiled from the
  next one on.

Nothing here issues a collective; the callback gathers the totals in ``on_step_end``.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack

import torch
from torch import nn

from hf_zero.profiling.analytic import analytic_flops, supports
from hf_zero.profiling.flops import FlopCounter
from hf_zero.profiling.params import count_params

__all__ = ["ThroughputMeter", "true_floating_point_ops"]

logger = logging.getLogger("hf_zero")


def _shape_and_tokens(kwargs: dict, args: tuple) -> tuple[int, int, int] | None:
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    mask = kwargs.get("attention_mask")
    tokens = int(mask.sum().item()) if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else ids.numel()
    return int(ids.shape[0]), int(ids.shape[1]), tokens


class ThroughputMeter:
    """Running totals since the last :meth:`take`: ``(tokens, model_flops, hardware_flops)`` of this rank."""

    def __init__(self, model: nn.Module, config):
        self.model = model            # the module the Trainer calls
        self.config = config          # the transformers config (None: no FLOPs, tokens only)
        self.tokens = 0
        self.model_flops = 0.0
        self.hardware_flops = 0.0
        self.flops_known = config is not None and supports(config)
        self._hw_ratio: float | None = None
        self._counted_per_token: float | None = None
        self._window: ExitStack | None = None
        self._counter: FlopCounter | None = None
        self._first_shape: tuple[int, int] | None = None
        self._handle = model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def remove(self) -> None:
        self._close_window()
        self._handle.remove()

    def _pre(self, module, args, kwargs):
        self._close_window()  # the counted micro-batch ended where the next call starts
        if not torch.is_grad_enabled():
            return
        found = _shape_and_tokens(kwargs, args)
        if found is None:
            return
        batch, seq, tokens = found
        self.tokens += tokens
        model_flops = self._model_flops(batch, seq)
        if self._hw_ratio is None and self._first_shape is None:
            self._first_shape = (batch, seq)
            self._counter = FlopCounter(self.model)
            self._window = ExitStack()
            self._window.enter_context(self._counter.window("auto"))
        if model_flops is not None:
            self.model_flops += model_flops
            self.hardware_flops += model_flops * (self._hw_ratio or 1.0)

    def _model_flops(self, batch: int, seq: int) -> float | None:
        if self.flops_known:
            return float(analytic_flops(self.config, batch, seq).training)
        if self._counted_per_token is not None:
            return self._counted_per_token * batch * seq
        return None

    def _close_window(self) -> None:
        if self._window is None:
            return
        self._window.close()
        self._window = None
        report, self._counter = self._counter.report, None
        if report.model <= 0:
            return
        batch, seq = self._first_shape
        self._hw_ratio = report.hardware / report.model
        # the first micro-batch was added with a ratio of 1: correct its hardware share now
        if self.flops_known:
            analytic = analytic_flops(self.config, batch, seq).training
            self.hardware_flops += analytic * (self._hw_ratio - 1.0)
            if abs(report.model - analytic) > 0.02 * analytic:
                logger.warning("hf_zero: analytic model FLOPs %.4g differ from the %.4g counted at the dispatcher "
                               "for a %dx%d batch; using the counted figure", analytic, report.model, batch, seq)
                self.flops_known = False
                self._counted_per_token = report.model / (batch * seq)
        else:
            self._counted_per_token = report.model / (batch * seq)
            self.model_flops += report.model
            self.hardware_flops += report.hardware

    def take(self) -> tuple[int, float, float]:
        """This rank's totals since the previous call, and reset them."""
        self._close_window()
        out = (self.tokens, self.model_flops, self.hardware_flops)
        self.tokens, self.model_flops, self.hardware_flops = 0, 0.0, 0.0
        return out


def true_floating_point_ops(model: nn.Module):
    """``Trainer.floating_point_ops`` with the model's true parameter count (6 x tokens x non-embedding params,
    transformers' own formula), so ``total_flos`` is the same at every ZeRO stage."""
    cache: dict[int, int] = {}

    def floating_point_ops(inputs) -> int:
        main = getattr(model, "main_input_name", "input_ids")
        if main not in inputs:
            return 0
        if id(model) not in cache:
            cache[id(model)] = count_params(model).non_embedding
        return 6 * inputs[main].numel() * cache[id(model)]

    return floating_point_ops
