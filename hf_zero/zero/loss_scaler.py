"""fp16 loss scaling: static, or dynamic with DeepSpeed's window/hysteresis semantics.

The overflow decision must be identical on every rank, so the caller passes a flag it has already agreed on
(the global gradient norm, all-reduced, is finite or not); this object never communicates.

Dynamic scaling follows DeepSpeed's ZeRO scaler (``DynamicLossScaler.update_scale``), step for step:

* overflow: with the hysteresis budget spent (``hysteresis_left == 1``, or ``hysteresis == 1``) the scale is
  divided by ``scale_factor``, never below ``min_scale``; an overflow already *at* ``min_scale`` is an error, as in
  DeepSpeed (every later step would be skipped too). Otherwise the budget drops by one and the scale stays.
* clean step: the scale is multiplied by ``scale_factor`` when ``good_steps`` -- the clean steps *before* this one
  since the last overflow (or since the start) -- is a positive multiple of ``window``. So the first raise comes on
  the ``window + 1``-th clean step, and the next ones every ``window`` clean steps after it. (DeepSpeed writes this
  ``stable_interval = cur_iter - last_overflow_iter - 1`` with ``last_overflow_iter = -1`` at the start; that
  difference is ``good_steps``.) A raise refills the hysteresis budget; with ``consecutive_hysteresis`` every
  clean step refills it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_zero.config.policies import LossScalePolicy

__all__ = ["LossScaler"]


@dataclass
class LossScaler:
    """``scale`` multiplies the loss before backward. ``dynamic`` scalers halve on overflow, grow after a window."""

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    scale_factor: float = 2.0
    # running state (what state_dict saves)
    good_steps: int = 0       # clean steps since the last overflow (or the start), before the current one
    hysteresis_left: int = 2  # overflows still absorbed before the scale drops; 1: the next overflow drops it

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's loss scaler attribute name for the current scale (also ``cur_scale``)."""
        return self.scale

    cur_scale = loss_scale

    @classmethod
    def from_policy(cls, policy: LossScalePolicy) -> "LossScaler":
        if policy.static_scale > 0:
            return cls(scale=policy.static_scale, dynamic=False)
        return cls(scale=2.0 ** policy.initial_scale_power, dynamic=True, window=policy.window,
                   hysteresis=policy.hysteresis, consecutive_hysteresis=policy.consecutive_hysteresis,
                   min_scale=policy.min_scale, hysteresis_left=policy.hysteresis)

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome (skipped on overflow) and adapt the scale."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left <= 1:
                if self.scale == self.min_scale:
                    raise RuntimeError(
                        f"hf_zero: fp16 gradients overflowed at the minimum loss scale {self.scale:g} "
                        "(fp16.min_loss_scale); every further step would be skipped, so training stops here, as "
                        "in DeepSpeed. Lower fp16.min_loss_scale, train in bf16, or find what makes the "
                        "gradients non-finite (learning rate, inputs)")
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.good_steps = 0
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.good_steps > 0 and self.good_steps % self.window == 0:
            self.scale *= self.scale_factor
            self.hysteresis_left = self.hysteresis
        self.good_steps += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
