"""DeepSpeed's ZeRO optimizer classes as names scripts import and test with ``isinstance``.

DeepSpeed's engine holds a ``DeepSpeedZeroOptimizer`` at ZeRO stages 1-2 and a ``DeepSpeedZeroOptimizer_Stage3`` at
stage 3; libraries import both at module level and branch on ``isinstance(engine.optimizer, ...)`` (agilerl, ROLL,
DeepSpeed's own tests). hf_zero has one optimizer for every stage (:class:`hf_zero.zero.optimizer.ZeroOptimizer`), so
these two are markers: ``isinstance`` is true for hf_zero's optimizer of an engine at the matching stage. They are
not constructible, and setting an attribute on them (a monkey-patch of DeepSpeed's class) warns that it has no
effect on hf_zero's optimizer, instead of being silently dropped.
"""

from __future__ import annotations

import warnings

from hf_zero.zero.optimizer import ZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"]


class _ZeroStageClass(type):
    _stages: tuple[int, ...] = ()

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, ZeroOptimizer) and getattr(obj, "zero_stage", None) in cls._stages

    def __call__(cls, *args, **kwargs):
        raise TypeError(f"hf_zero: {cls.__name__} is DeepSpeed's optimizer class; hf_zero's engine builds its own "
                        f"(hf_zero.zero.optimizer.ZeroOptimizer): pass the optimizer config or a torch optimizer to "
                        f"deepspeed.initialize")

    def __setattr__(cls, name: str, value) -> None:
        if not name.startswith("_"):
            warnings.warn(f"hf_zero: setting {cls.__name__}.{name} has no effect: hf_zero's engine uses "
                          f"hf_zero.zero.optimizer.ZeroOptimizer, not DeepSpeed's {cls.__name__}", stacklevel=2)
        super().__setattr__(name, value)


class DeepSpeedZeroOptimizer(metaclass=_ZeroStageClass):
    """``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer``: hf_zero's optimizer at ZeRO stages 1-2."""

    _stages = (1, 2)


class DeepSpeedZeroOptimizer_Stage3(metaclass=_ZeroStageClass):
    """``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3``: hf_zero's optimizer at ZeRO stage 3."""

    _stages = (3,)
