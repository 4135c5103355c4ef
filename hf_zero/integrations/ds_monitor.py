"""``deepspeed.monitor.monitor.MonitorMaster``: DeepSpeed's fan-out of ``write_events([(tag, value, step), ...])``
to TensorBoard, W&B, CSV files and Comet -- hf_zero's own (:mod:`hf_zero.runtime.monitor`), the class every engine
keeps as ``engine.monitor``. Scripts build one from ``deepspeed.DeepSpeedConfig(...).monitor_config`` (or a dict of
the ``tensorboard``/``wandb``/``csv_monitor``/``comet`` sections) and write their own events through it."""

from __future__ import annotations

from hf_zero.runtime.monitor import MonitorMaster

__all__ = ["MonitorMaster"]
