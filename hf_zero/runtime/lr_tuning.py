"""DeepSpeed's command-line tuning of the LR schedules: ``add_tuning_arguments(parser)`` adds the
"Convergence Tuning" flags (``--lr_schedule``, ``--warmup_max_lr``, ...), :func:`get_config_from_args` turns parsed
flags into a ``{"type": ..., "params": {...}}`` scheduler config, :func:`get_lr_from_config` reads the learning
rate that config peaks at. Flag names, defaults and the (config, error message) return pairs are DeepSpeed's
(``deepspeed.runtime.lr_schedules``), so scripts written against them parse the same command lines.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from .lr_schedules import LR_RANGE_TEST, ONE_CYCLE, VALID_LR_SCHEDULES, WARMUP_COSINE_LR, WARMUP_LOG_RATE

__all__ = ["add_tuning_arguments", "parse_arguments", "get_config_from_args", "get_lr_from_config"]

# (flag, type, default, help); a type of None is a store_true switch
_FLAGS: tuple[tuple[str, Any, Any, str], ...] = (
    ("lr_schedule", str, None, "LR schedule for training."),
    ("lr_range_test_min_lr", float, 0.001, "Starting lr value."),
    ("lr_range_test_step_rate", float, 1.0, "scaling rate for LR range test."),
    ("lr_range_test_step_size", int, 1000, "training steps per LR change."),
    ("lr_range_test_staircase", None, False, "use staircase scaling for LR range test."),
    ("cycle_first_step_size", int, 1000, "size of first step of 1Cycle schedule (training steps)."),
    ("cycle_first_stair_count", int, -1, "first stair count for 1Cycle schedule."),
    ("cycle_second_step_size", int, -1, "size of second step of 1Cycle schedule (default first_step_size)."),
    ("cycle_second_stair_count", int, -1, "second stair count for 1Cycle schedule."),
    ("decay_step_size", int, 1000, "size of intervals for applying post cycle decay (training steps)."),
    ("cycle_min_lr", float, 0.01, "1Cycle LR lower bound."),
    ("cycle_max_lr", float, 0.1, "1Cycle LR upper bound."),
    ("decay_lr_rate", float, 0.0, "post cycle LR decay rate."),
    ("cycle_momentum", None, False, "Enable 1Cycle momentum schedule."),
    ("cycle_min_mom", float, 0.8, "1Cycle momentum lower bound."),
    ("cycle_max_mom", float, 0.9, "1Cycle momentum upper bound."),
    ("decay_mom_rate", float, 0.0, "post cycle momentum decay rate."),
    ("warmup_min_lr", float, 0, "WarmupLR minimum/initial LR value"),
    ("warmup_max_lr", float, 0.001, "WarmupLR maximum LR value."),
    ("warmup_num_steps", int, 1000, "WarmupLR step count for LR warmup."),
    ("warmup_type", str, WARMUP_LOG_RATE, "WarmupLR increasing function during warmup"),
    ("warmup_min_ratio", float, 0.01, "Cosine LR lower bound."),
    ("cos_min_ratio", float, 0.01, "Cosine LR lower bound."),
)

# The flags each schedule's config takes from the command line (DeepSpeed's; 1Cycle's takes no cycle_momentum,
# WarmupCosineLR's no warmup_min_lr/warmup_max_lr: it scales each group's own lr by a ratio).
_SCHEDULE_FLAGS: dict[str, tuple[str, ...]] = {
    LR_RANGE_TEST: ("lr_range_test_min_lr", "lr_range_test_step_rate", "lr_range_test_step_size",
                    "lr_range_test_staircase"),
    ONE_CYCLE: ("cycle_first_step_size", "cycle_first_stair_count", "cycle_second_step_size",
                "cycle_second_stair_count", "decay_step_size", "cycle_min_lr", "cycle_max_lr", "decay_lr_rate",
                "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"),
    WARMUP_COSINE_LR: ("warmup_num_steps", "warmup_type", "warmup_min_ratio", "cos_min_ratio"),
}
_WARMUP_FLAGS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")  # WarmupLR, WarmupDecayLR

# The param holding the learning rate a schedule peaks at (None: the schedule defines no lr of its own).
_PEAK_LR_PARAM = {LR_RANGE_TEST: "lr_range_test_min_lr", ONE_CYCLE: "cycle_max_lr", WARMUP_COSINE_LR: None}


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's "Convergence Tuning" group to ``parser``; returns ``parser``."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    for name, type_, default, help_ in _FLAGS:
        if type_ is None:
            group.add_argument(f"--{name}", default=default, action="store_true", help=help_)
        else:
            group.add_argument(f"--{name}", type=type_, default=default, help=help_)
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """The tuning flags of ``sys.argv`` and the arguments that are not tuning flags."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def get_config_from_args(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """``({"type": args.lr_schedule, "params": {...}}, None)`` from the flags that schedule takes (a flag missing
    from ``args`` or None is left out), or ``(None, reason)`` when ``--lr_schedule`` is absent or unknown."""
    schedule = getattr(args, "lr_schedule", None)
    if schedule is None:
        return None, "--lr_schedule not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    params = {name: getattr(args, name) for name in _SCHEDULE_FLAGS.get(schedule, _WARMUP_FLAGS)
              if getattr(args, name, None) is not None}
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config: Mapping[str, Any]) -> tuple[float | None, str]:
    """``(peak learning rate, "")`` of a scheduler config, or ``(None, reason)``. A params dict without the lr key
    raises KeyError, as DeepSpeed's."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    key = _PEAK_LR_PARAM.get(schedule, "warmup_max_lr")
    if key is None:
        return None, f"{WARMUP_COSINE_LR} scales the optimizer learning rate by a ratio, so its params define no lr"
    return params[key], ""
