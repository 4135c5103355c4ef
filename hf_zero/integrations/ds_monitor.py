"""``deepspeed.monitor.monitor.MonitorMaster``: DeepSpeed's fan-out of ``write_events([(tag, value, step), ...])``
to TensorBoard, W&B, CSV and Comet.

hf_zero writes no metrics itself (``tensorboard``/``csv_monitor``/``wandb``/``comet`` are "not implemented" in
``hf_zero/config/status.py``; the HF Trainer's ``report_to`` does it). So a MonitorMaster whose config enables a
monitor warns once, naming those sections as the config check does, and its ``write_events`` records nothing. A
script's own ``write_events`` calls keep working (they are how DeepSpeed-era scripts log), they just go nowhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from hf_zero.config.status import STATUS, ConfigKeyIgnored

__all__ = ["MonitorMaster", "MONITOR_SECTIONS"]

MONITOR_SECTIONS = ("tensorboard", "wandb", "csv_monitor", "comet")


def _section_enabled(section: Any) -> bool:
    if isinstance(section, Mapping):
        return section.get("enabled") is True
    return getattr(section, "enabled", False) is True


def _section(monitor_config: Any, name: str) -> Any:
    if isinstance(monitor_config, Mapping):
        return monitor_config.get(name)
    return getattr(monitor_config, name, None)


class MonitorMaster:
    """``MonitorMaster(monitor_config)``: ``monitor_config`` is DeepSpeed's (``DeepSpeedConfig(...).monitor_config``),
    or a config dict holding the monitor sections. ``enabled`` says whether any monitor was asked for."""

    def __init__(self, monitor_config: Any):
        self.enabled_sections = tuple(name for name in MONITOR_SECTIONS
                                      if _section_enabled(_section(monitor_config, name)))
        self.enabled = bool(self.enabled_sections)
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None
        if self.enabled:
            notes = "; ".join(f"{name}: {STATUS[name].note}" for name in self.enabled_sections)
            warnings.warn(f"hf_zero: config key(s) {', '.join(self.enabled_sections)} are not implemented in hf_zero "
                          f"({notes}); deepspeed.monitor.MonitorMaster.write_events records nothing",
                          ConfigKeyIgnored, stacklevel=2)

    def write_events(self, event_list) -> None:
        """Nothing is written (see the module docstring); the events are accepted so training goes on."""
