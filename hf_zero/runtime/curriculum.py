"""DeepSpeed's legacy curriculum (the top-level ``curriculum_learning`` section Megatron-DeepSpeed uses).

The engine owns one :class:`CurriculumScheduler` when the section is enabled (``engine.curriculum_scheduler_legacy``).
Each forward while training, :meth:`CurriculumScheduler.update_difficulty` is called with ``global_steps + 1``;
for ``curriculum_type`` seqlen the engine passes the current difficulty to the model as ``curriculum_seqlen=``.

Schedules, with ``s`` the step, ``lo``/``hi`` the min/max difficulty and ``d`` the difficulty_step:

* ``fixed_linear``:   ``floor((s / total_curriculum_step) * (hi - lo) + lo)``, rounded down to a multiple of ``d``;
* ``fixed_root``:     the same with ``(s / total_curriculum_step) ** (1 / root_degree)``;
* ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``s <= max_step[i]``, the last one after them;
* ``custom``:         a function of the step set with :meth:`CurriculumScheduler.set_custom_get_difficulty`.

Both root schedules are then clamped to ``[ceil(lo / d) * d, hi]`` (DeepSpeed 0.19.8's ``CurriculumScheduler``:
rounding down could otherwise give a difficulty below ``lo``, a zero-length sequence). Once the difficulty reaches
``hi`` it is not recomputed. DeepSpeed removed the top-level section in 0.19 (it refuses the key and points to
``data_efficiency``); hf_zero runs it as the releases before did.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from hf_zero.config.sections import CurriculumLearningConfig

__all__ = ["CurriculumScheduler"]

logger = logging.getLogger("hf_zero")


class CurriculumScheduler:
    """The difficulty of each step under one ``curriculum_learning`` section (which must be enabled)."""

    def __init__(self, config: CurriculumLearningConfig):
        if not config.enabled:
            raise ValueError("CurriculumScheduler needs an enabled curriculum_learning section")
        self.config = config
        self.schedule = config.schedule_config
        self.current_difficulty: int = config.min_difficulty
        self._custom: Callable[[int], int] | None = None
        step = self.schedule.difficulty_step
        if config.schedule_type in ("fixed_linear", "fixed_root") and config.curriculum_type == "seqlen" \
                and step % 8 != 0:
            logger.warning("hf_zero: curriculum_learning.schedule_config.difficulty_step %d is not a multiple of 8: "
                           "sequence lengths that are not multiples of 8 (fp16) or 16 (int8) do not use Tensor Cores",
                           step)

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The difficulty of each step for ``schedule_type`` custom."""
        self._custom = schedule_function

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at step ``global_steps`` (the current difficulty is not changed)."""
        kind = self.config.schedule_type
        if kind == "fixed_discrete":
            return self._discrete(global_steps)
        if kind == "fixed_linear":
            return self._root(global_steps, 1)
        if kind == "fixed_root":
            return self._root(global_steps, self.schedule.root_degree)
        if self._custom is None:
            raise RuntimeError("hf_zero: curriculum_learning.schedule_type is 'custom' but no schedule was set; call "
                               "engine.curriculum_scheduler_legacy.set_custom_get_difficulty(fn) before training")
        return self._custom(global_steps)

    def update_difficulty(self, global_steps: int) -> int:
        """Move to the difficulty of step ``global_steps``, unless max_difficulty was reached; returns it."""
        if self.current_difficulty < self.config.max_difficulty:
            self.current_difficulty = self.get_difficulty(global_steps)
        return self.current_difficulty

    def get_current_difficulty(self) -> int:
        return self.current_difficulty

    def set_current_difficulty(self, difficulty: int) -> None:
        self.current_difficulty = difficulty

    def _discrete(self, global_steps: int) -> int:
        difficulty, max_step = self.schedule.difficulty, self.schedule.max_step
        for level, last_step in zip(difficulty, max_step):
            if global_steps <= last_step:
                return level
        return difficulty[-1]

    def _root(self, global_steps: int, degree: int) -> int:
        lo, hi = self.config.min_difficulty, self.config.max_difficulty
        step = self.schedule.difficulty_step
        fraction = (float(global_steps) / self.schedule.total_curriculum_step) ** (1.0 / degree)
        difficulty = math.floor(fraction * (hi - lo) + lo)
        difficulty -= difficulty % step
        difficulty = max(difficulty, -(-lo // step) * step)  # the first multiple of step at or above lo
        return min(difficulty, hi)

    # ---- checkpoints (hf_zero/checkpoint/engine.py) ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state a resumed run needs: the current difficulty (the schedule itself comes from the config)."""
        return {"current_difficulty": self.current_difficulty}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_difficulty = int(state["current_difficulty"])
