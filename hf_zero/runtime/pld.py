"""Progressive layer dropping (``progressive_layer_drop``; DeepSpeed's ``ProgressiveLayerDrop``, arXiv 2010.13369).

The engine owns the schedule; the model owns the dropping. Each training forward gets ``progressive_layer_drop=True``
and ``pld_theta=<keep probability>``, and a model written for PLD (DeepSpeedExamples' BERT) skips layers with it.
After the optimizer step of global step ``s`` the keep probability becomes ``(1 - theta) * exp(-gamma * s) + theta``
(DeepSpeed computes it with the step count before that step's increment, so the first forward sees 1.0 and the
forward after step ``s`` sees the value for ``s``).
"""

from __future__ import annotations

import math

__all__ = ["ProgressiveLayerDrop"]


class ProgressiveLayerDrop:
    """DeepSpeed's class and methods (``deepspeed.runtime.progressive_layer_drop.ProgressiveLayerDrop``)."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0

    def get_state(self) -> dict:
        """The keyword arguments a training forward receives."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = (1.0 - self.theta) * math.exp(-self.gamma * global_step) + self.theta
