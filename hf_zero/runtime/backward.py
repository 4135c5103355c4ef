"""One backward pass of the engine, whoever starts it: ``engine.backward(loss)`` or ``loss.backward()``.

DeepSpeed scripts call either. Both must train identically, so the engine's part of a backward -- telling the
gradient reducer whether this micro-step reduces, dividing by the accumulation steps, finishing the reduction --
cannot live in ``engine.backward`` alone. As in DeepSpeed, the engine's forward puts a gradient hook on every
output tensor that requires grad; the first one to fire in a backward pass that the engine did not start opens a
session (the same prologue as ``engine.backward``), each output's incoming gradient is divided by the accumulation
steps there (what ``engine.backward`` does to the loss), and the end of the pass (an autograd engine callback)
closes it. ``engine.backward`` opens and closes the session itself and scales the loss, so the hooks leave
gradients alone while it runs.

fp16 loss scaling cannot be moved onto the outputs exactly (the output gradient is already rounded to fp16 there),
so with fp16 a direct ``loss.backward()`` must be ``engine.scale(loss).backward()``; anything else is refused on
the first backward, before any gradient exists (DeepSpeed raises the same).

A parameter gradient produced outside any session -- another engine's loss back-propagated through this model (a
GAN: the generator's loss flows through the discriminator), or a loss computed from ``engine.module(...)`` -- is
handled as DeepSpeed does at stages 0-2: left in ``param.grad``, neither reduced nor stepped by this engine, with one
warning per engine naming the parameter (:meth:`tolerate`; a GAN script clears it with ``netD.zero_grad()``). At
ZeRO-3 it is refused (:meth:`guard`): a partitioned parameter has no place to keep a full gradient.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable

import torch

from hf_zero.util.tensors import functorch_transforming

logger = logging.getLogger("hf_zero")

__all__ = ["BackwardSessions"]


class BackwardSessions:
    """``begin()`` / ``end()`` are the engine's prologue and epilogue; ``gas()`` its accumulation steps;
    ``loss_scale()`` the fp16 scale or None when there is no loss scaling."""

    def __init__(self, *, begin: Callable[[], None], end: Callable[[], None], gas: Callable[[], int],
                 loss_scale: Callable[[], float | None], timers: Callable[[], Any]):
        self._begin, self._end, self._gas, self._loss_scale, self._timers = begin, end, gas, loss_scale, timers
        self.active = False           # between prologue and epilogue
        self._by_engine = False       # engine.backward is running: the loss is scaled already
        self._user_scaled = False     # engine.scale(loss) was called for the next direct backward
        self.scale_wrt_gas = True     # the last engine.backward's choice, kept for direct backwards (DeepSpeed's)
        self._last_loss: torch.Tensor | float | None = None
        self._outside_warned = False
        self._started = 0.0

    @property
    def last_loss(self) -> float | None:
        """The loss of the last backward, as a float. Kept as the detached tensor until read: on a GPU, reading it
        at every backward would be a host synchronisation per micro-step (the step log reads it once per print)."""
        loss = self._last_loss
        if isinstance(loss, torch.Tensor):
            loss = self._last_loss = float(loss.float().item())
        return loss

    @last_loss.setter
    def last_loss(self, loss: torch.Tensor | float | None) -> None:
        self._last_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss

    # ---- engine.backward -------------------------------------------------------------------------------------------
    def run_engine_backward(self, scaled_loss: torch.Tensor, retain_graph: bool) -> None:
        self._by_engine = True
        self._open()
        try:
            scaled_loss.backward(retain_graph=retain_graph)
        except BaseException:
            self.active = False  # the reducer is mid-pass: its epilogue would wait for collectives that never come
            raise
        finally:
            self._by_engine = False
        self._close()

    def mark_user_scaled(self) -> None:
        self._user_scaled = True

    # ---- direct tensor.backward() on engine outputs ----------------------------------------------------------------
    def watch(self, output: Any) -> None:
        """Hook every tensor in ``output`` (tensors, tuples, lists, dicts / ModelOutput) that has a grad_fn."""
        if isinstance(output, torch.Tensor):
            if output.requires_grad and output.grad_fn is not None:
                ref = weakref.ref(output)
                output.register_hook(lambda grad: self._on_output_grad(grad, ref))
        elif isinstance(output, (tuple, list)):
            for o in output:
                self.watch(o)
        elif isinstance(output, dict):
            for o in output.values():
                self.watch(o)

    def _on_output_grad(self, grad: torch.Tensor, ref) -> torch.Tensor:
        if self._by_engine or functorch_transforming():
            # torch.func.grad / vjp / jacrev over engine(...): a function transform asking for a derivative, not a
            # training backward -- nothing to reduce, and no accumulation-steps division (DeepSpeed skips it too)
            return grad
        if not self.active:
            scale = self._loss_scale()
            if scale is not None and not self._user_scaled:
                raise RuntimeError(
                    "hf_zero: Loss scaling is required: fp16 training scales the loss, and backward() was called "
                    "on the engine's output without it. Call engine.backward(loss), or "
                    "engine.scale(loss).backward() (as in DeepSpeed, whose error starts the same)")
            self._user_scaled = False
            tensor = ref()
            if tensor is not None and tensor.numel() == 1:
                self.last_loss = tensor
            self._open()
            torch.autograd.Variable._execution_engine.queue_callback(self._close)
        if self.scale_wrt_gas and self._gas() > 1:
            return grad / self._gas()
        return grad

    # ---- both --------------------------------------------------------------------------------------------------------
    def tolerate(self, name: str) -> None:
        """Stages 0-2: a gradient outside every session stays in ``param.grad`` (the reducer is not reducing then);
        said once (see the module docstring)."""
        if self.active or self._outside_warned:
            return
        self._outside_warned = True
        logger.warning(
            "hf_zero: the gradient of %r comes from a backward pass this engine did not run (another engine's loss "
            "back-propagated through this model, as a GAN's generator loss does through its discriminator, or a loss "
            "computed from engine.module(...)). As in DeepSpeed it is left in .grad, not reduced or stepped by this "
            "engine: clear it (model.zero_grad()) before this engine's next backward, or compute this engine's loss "
            "from engine(...)'s output. Said once per engine.", name)

    def guard(self, name: str) -> None:
        """Called as each parameter gradient arrives: a gradient outside every session was not seen by the engine."""
        if not self.active:
            raise RuntimeError(
                f"hf_zero: the gradient of {name!r} comes from a backward pass the engine did not see: the loss was "
                "not computed from the output of engine(...) (calling engine.module(...) bypasses the engine). "
                "Compute the loss from engine(...)'s output, or call engine.backward(loss)")

    def _open(self) -> None:
        self.active = True
        self._started = time.perf_counter()
        self._begin()

    def _close(self) -> None:
        if not self.active:
            return
        try:
            self._end()
        finally:
            self.active = False
            self._timers().add("backward", time.perf_counter() - self._started)

