"""fp16 loss scaling: static, or dynamic with DeepSpeed's window/hysteresis semantics.

The overflow decision must be identical on every rank, so the caller passes a flag it has already agreed on
(the global gradient norm, all-reduced, is finite or not); this object never communicates.
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
    # running state
    good_steps: int = 0
    hysteresis_left: int = 2

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
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.good_steps = 0
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= self.scale_factor
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
