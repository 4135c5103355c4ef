"""``zero_optimization.zenflow``: ZenFlow's selective updates on top of a ZeRO-1/2 CPU optimizer offload.

DeepSpeed's keys, defaults and checks (``deepspeed/runtime/zenflow/zenflow_config.py`` and the engine's
``configure_zenflow``), so a config written for DeepSpeed is accepted or refused the same way. What the keys do is
in :mod:`hf_zero.zero.zenflow` and ``docs/zenflow.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError
from .schema import Auto, AUTO, spec

__all__ = ["ZenFlowConfig"]


@dataclass(frozen=True, kw_only=True)
class ZenFlowConfig:
    """``zero_optimization.zenflow``: top-k gradient columns updated every step on the device, the rest
    accumulated and applied by the offloaded optimizer every ``update_interval`` steps."""

    topk_ratio: float = spec(0.1, help="Fraction of each 2-D weight's columns (input features) updated every step "
                                       "on the device; 0 < topk_ratio < 1.")
    select_strategy: Literal["step", "epoch"] | Auto = spec(
        AUTO, auto=True, help="When the columns are re-selected: every select_interval steps ('step'), every "
                              "select_interval epochs of the initialize() dataloader ('epoch'), or 'auto' (every "
                              "epoch).")
    select_interval: int | Auto = spec(
        AUTO, auto=True, help="Steps (or epochs) between column selections, 0: select once; 'auto' only with "
                              "select_strategy 'auto'.")
    update_interval: int | Auto = spec(
        AUTO, auto=True, help="Steps between offloaded-optimizer updates (it replaces gradient_accumulation_steps, "
                              "as in DeepSpeed); 'auto': when the unselected gradients have grown (auto_ratio).")
    overlap_step: bool = spec(False, help="DeepSpeed runs the offloaded step while the next window computes: each "
                                          "window's update reaches the weights at the next update, with two sets "
                                          "of Adam moments used alternately. hf_zero gives the same numbers, "
                                          "computed in order (no speed-up).")
    offload: bool = spec(False, help="Keep the selective optimizer's moments in CPU memory between steps "
                                     "(memory only; the values are the same).")
    auto_ratio: float = spec(0.99, help="update_interval 'auto': fraction of the 2-D weights whose unselected "
                                        "gradient mass must pass the selected one before an update; 0..1.")
    full_warm_up_rounds: int = spec(0, help="First steps in which every step is a full offloaded-optimizer update.")
    pt_reserved_cores_perc: float = spec(
        0.5, help="Share of the CPU cores DeepSpeed's overlap_step optimizer process leaves to PyTorch (0..1); "
                  "hf_zero runs that step in this process and only checks the range.")

    def __post_init__(self) -> None:
        if not 0.0 < self.topk_ratio < 1.0:
            raise ConfigError("topk_ratio", f"value {self.topk_ratio} is not accepted; use 0 < topk_ratio < 1")
        if not 0.0 <= self.auto_ratio <= 1.0:
            raise ConfigError("auto_ratio", f"value {self.auto_ratio} is not accepted; use 0 <= auto_ratio <= 1")
        if not 0.0 <= self.pt_reserved_cores_perc <= 1.0:
            raise ConfigError("pt_reserved_cores_perc",
                              f"value {self.pt_reserved_cores_perc} is not accepted; use a fraction in [0, 1]")
        if not isinstance(self.update_interval, Auto) and self.update_interval < 1:
            raise ConfigError("update_interval", f"value {self.update_interval} is not accepted; use an integer "
                                                 ">= 1 or 'auto'")
        if not isinstance(self.select_interval, Auto) and self.select_interval < 0:
            raise ConfigError("select_interval", f"value {self.select_interval} is not accepted; use an integer "
                                                 ">= 0 (0: select once) or 'auto'")
        # Refused, not approximated: each would train differently from what DeepSpeed documents
        if isinstance(self.update_interval, Auto):
            raise ConfigError("update_interval", "'auto' is not implemented in hf_zero; give a number of steps. "
                                                 "(DeepSpeed 0.19.8 sets gradient_accumulation_steps to 0 with it "
                                                 "and divides the loss by that: NaN weights from the second step.)")
        if self.full_warm_up_rounds < 0:
            raise ConfigError("full_warm_up_rounds", f"must be >= 0, got {self.full_warm_up_rounds}")
        # DeepSpeed's configure_zenflow: 'auto' selection re-selects every epoch and owns the interval
        if isinstance(self.select_strategy, Auto) and not isinstance(self.select_interval, Auto):
            raise ConfigError("select_interval", f"{self.select_interval} with select_strategy 'auto' (which "
                                                 "re-selects every epoch): leave select_interval 'auto' or set "
                                                 "select_strategy 'step' or 'epoch'")
        if not isinstance(self.select_strategy, Auto) and isinstance(self.select_interval, Auto):
            raise ConfigError("select_interval", f"'auto' with select_strategy '{self.select_strategy}': give the "
                                                 "interval as a number")
        if (self.select_strategy == "step" and not isinstance(self.update_interval, Auto)
                and 0 < self.select_interval < self.update_interval):
            raise ConfigError("select_interval", f"{self.select_interval} is less than update_interval "
                                                 f"{self.update_interval}; it must be greater or equal (DeepSpeed's "
                                                 "rule)")
