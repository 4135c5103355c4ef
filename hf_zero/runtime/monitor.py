"""DeepSpeed's metric monitors -- ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet`` -- writing what DeepSpeed
0.19.8 writes, where and when it writes it. The engine owns one (``engine.monitor``); scripts add their own events:

    engine.monitor.write_events([("Train/Samples/my_metric", value, engine.global_samples)])

An event is ``(tag, value, step)``; the engine's step is the run's sample count (``engine.global_samples``). What the
engines write (``boundary_events``, called once per optimizer step, after the optimizer and scheduler steps):

* every engine, at each gradient-accumulation boundary (a step an fp16 overflow skipped included):
  ``Train/Samples/lr`` (the first parameter group's learning rate, after the scheduler step),
  ``Train/Samples/loss_scale`` (fp16 only, after the scale's update) and, with ``wall_clock_breakdown``,
  ``Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,backward_allreduce,step}``
  (the step's milliseconds, from the engine's phase timers: ``backward_allreduce`` is the time spent waiting in
  collectives, at ZeRO-3 parameter gathers included, ``backward_inner`` the rest of the backward; DeepSpeed also
  writes them when only ``flops_profiler`` is enabled, hf_zero's phase timers run with ``wall_clock_breakdown`` only);
* the pipeline engine, in place of the timings: ``Train/Samples/train_loss`` (``train_batch``'s mean loss) and
  ``Train/Samples/eval_loss`` (``eval_batch``'s).

DeepSpeed's engine writes no loss outside the pipeline engine; neither does this one.

Only global rank 0 writes: it makes the directories and opens the writers at ``initialize``. Every rank checks, also
at ``initialize``, that the library an enabled section needs is importable, so a missing one stops every rank with
an error naming the key rather than rank 0 alone. Files:

* ``csv_monitor``: ``<output_path>/<job_name>/<tag, '/' and ' ' replaced by '_'>.csv``, opened for append at each
  write; the first write of a file in a process adds the header ``step,<the tag's last '/' part>``; rows
  ``step,value`` (Python's ``csv`` module: values as ``str()`` gives them, ``\\r\\n`` line ends).
* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter(log_dir=<output_path>/<job_name>)``; ``add_scalar(tag,
  value, step)`` per event, flushed after each ``write_events``.
* ``wandb``: ``wandb.init(project=project, group=group, entity=team)``; ``wandb.log({tag: value}, step=step)`` per
  event.
* ``comet``: ``comet_ml.start(api_key=, project=, workspace=, experiment_key=, mode=, online=)`` then
  ``set_name(experiment_name)`` when given; an event is sent (``log_metric(tag, value, step=step)``) when its tag
  was never sent or ``samples_log_interval`` samples have passed since it last was.
"""

from __future__ import annotations

import csv
import importlib
import os
from collections.abc import Mapping
from typing import Any, Sequence

from hf_zero import comm
from hf_zero.config.errors import ConfigError
from hf_zero.config.schema import parse
from hf_zero.config.sections import CometConfig, MonitorConfig, WandbConfig

__all__ = ["MonitorMaster", "CsvMonitor", "TensorBoardMonitor", "WandbMonitor", "CometMonitor", "boundary_events",
           "Event"]

Event = tuple[str, Any, int]  # (tag, value, step): step is the run's sample count for the engine's events

_SECTIONS = {"tensorboard": MonitorConfig, "wandb": WandbConfig, "csv_monitor": MonitorConfig,
             "comet": CometConfig}
_COMET_MIN_VERSION = (3, 41, 0)  # comet_ml.start() and the arguments DeepSpeed passes to it


def boundary_events(samples: int, lr: float, loss_scale: float | None = None,
                    phase_seconds: Mapping[str, float] | None = None) -> list[Event]:
    """The events an engine writes at a gradient-accumulation boundary. ``loss_scale``: the fp16 scale (None
    without fp16); ``phase_seconds``: this step's phase timers (``wall_clock_breakdown``; None without)."""
    events: list[Event] = [("Train/Samples/lr", lr, samples)]
    if loss_scale is not None:
        events.append(("Train/Samples/loss_scale", loss_scale, samples))
    if phase_seconds is not None:
        ms = {name: 1000.0 * seconds for name, seconds in phase_seconds.items()}
        backward, waiting = ms.get("backward", 0.0), ms.get("communication", 0.0)
        events += [("Train/Samples/elapsed_time_ms_forward", ms.get("forward", 0.0), samples),
                   ("Train/Samples/elapsed_time_ms_backward", backward, samples),
                   ("Train/Samples/elapsed_time_ms_backward_inner", max(backward - waiting, 0.0), samples),
                   ("Train/Samples/elapsed_time_ms_backward_allreduce", waiting, samples),
                   ("Train/Samples/elapsed_time_ms_step", ms.get("step", 0.0), samples)]
    return events


def _job_dir(section: MonitorConfig) -> str:
    log_dir = os.path.join(section.output_path, section.job_name)
    os.makedirs(log_dir, exist_ok=True)
    return log_dir


class CsvMonitor:
    """``csv_monitor``: one CSV file per tag (layout in the module docstring)."""

    def __init__(self, section: MonitorConfig):
        self.log_dir = _job_dir(section)
        self._headed: set[str] = set()  # files this process has written a header to

    def write_events(self, event_list: Sequence[Event]) -> None:
        for tag, value, step in event_list:
            name = tag.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, name + ".csv"), "a", newline="") as f:
                writer = csv.writer(f)
                if name not in self._headed:
                    self._headed.add(name)
                    writer.writerow(["step", tag.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        """Nothing stays open between writes."""


class TensorBoardMonitor:
    """``tensorboard``: one ``SummaryWriter`` on ``<output_path>/<job_name>``."""

    def __init__(self, section: MonitorConfig):
        from torch.utils.tensorboard import SummaryWriter

        self.summary_writer = SummaryWriter(log_dir=_job_dir(section))

    def write_events(self, event_list: Sequence[Event], flush: bool = True) -> None:
        for tag, value, step in event_list:
            self.summary_writer.add_scalar(tag, value, step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()


class WandbMonitor:
    """``wandb``: logs into the process's W&B run, started here with the section's project, group and team."""

    def __init__(self, section: WandbConfig, wandb: Any):
        self._wandb = wandb
        wandb.init(project=section.project, group=section.group, entity=section.team)

    def log(self, data: dict, step: int | None = None, commit: bool | None = None):
        return self._wandb.log(data, step=step, commit=commit)

    def write_events(self, event_list: Sequence[Event]) -> None:
        for tag, value, step in event_list:
            self.log({tag: value}, step=step)

    def close(self) -> None:
        """The run is the process's global W&B run, which the script (or the HF Trainer's callback) may share: W&B
        finishes it at exit, as under DeepSpeed."""


class CometMonitor:
    """``comet``: one experiment; each tag is sent at most once per ``samples_log_interval`` samples."""

    def __init__(self, section: CometConfig, comet_ml: Any):
        self.samples_log_interval = section.samples_log_interval
        self.experiment = comet_ml.start(api_key=section.api_key, project=section.project,
                                         workspace=section.workspace, experiment_key=section.experiment_key,
                                         mode=section.mode, online=section.online)
        if section.experiment_name is not None:
            self.experiment.set_name(section.experiment_name)
        self._last_sent: dict[str, int] = {}  # tag -> the step it was last sent at

    def write_events(self, event_list: Sequence[Event]) -> None:
        for tag, value, step in event_list:
            last = self._last_sent.get(tag)
            if last is None or step - last >= self.samples_log_interval:
                self._last_sent[tag] = step
                self.experiment.log_metric(tag, value, step=step)

    def close(self) -> None:
        """The experiment is Comet's process-wide one; Comet ends it at exit, as under DeepSpeed."""


def _sections(monitor_config: Any) -> dict[str, Any]:
    """The four typed sections from an HfZeroConfig, ``deepspeed.DeepSpeedConfig(...).monitor_config``, or a dict
    of the sections as JSON (checked key by key like the config file)."""
    get = monitor_config.get if isinstance(monitor_config, Mapping) else (
        lambda name: getattr(monitor_config, name, None))
    return {name: parse(cls, get(name), name) for name, cls in _SECTIONS.items()}


def _library(module: str, key: str, install: str) -> Any:
    """Import what an enabled section needs, or name the key and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(key, f"true needs the {module!r} module, which cannot be imported here ({error}): install "
                               f"it (`{install}`), or set {key} to false") from None


def _check_comet_version(comet_ml: Any) -> None:
    version = str(getattr(comet_ml, "__version__", "0"))
    parts = tuple(int(p) if p.isdigit() else 0 for p in version.split("+")[0].split(".")[:3])
    if parts < _COMET_MIN_VERSION:
        raise ConfigError("comet.enabled", f"true needs comet_ml >= 3.41.0 (comet_ml.start), found {version}; "
                                           "`pip install -U comet_ml`, or set comet.enabled to false")


class MonitorMaster:
    """DeepSpeed's ``MonitorMaster``: the enabled monitors, written in DeepSpeed's order (tensorboard, wandb, csv,
    comet). ``enabled`` is the same on every rank; ``tb_monitor``/``wandb_monitor``/``csv_monitor``/
    ``comet_monitor`` exist on global rank 0 only (None elsewhere and when their section is off)."""

    def __init__(self, monitor_config: Any):
        sections = _sections(monitor_config)
        self.enabled = any(section.enabled for section in sections.values())
        self.tb_monitor: TensorBoardMonitor | None = None
        self.wandb_monitor: WandbMonitor | None = None
        self.csv_monitor: CsvMonitor | None = None
        self.comet_monitor: CometMonitor | None = None
        self._closed = False
        # every rank: a missing library fails the whole run at initialize, not rank 0 alone
        if sections["tensorboard"].enabled:
            _library("tensorboard", "tensorboard.enabled", "pip install tensorboard")
            _library("torch.utils.tensorboard", "tensorboard.enabled", "pip install tensorboard")
        wandb = _library("wandb", "wandb.enabled", "pip install wandb") if sections["wandb"].enabled else None
        comet_ml = _library("comet_ml", "comet.enabled", 'pip install "comet_ml>=3.41.0"') \
            if sections["comet"].enabled else None
        if comet_ml is not None:
            _check_comet_version(comet_ml)
        self.rank = comm.get_rank()
        if self.rank != 0:
            return
        if sections["tensorboard"].enabled:
            self.tb_monitor = TensorBoardMonitor(sections["tensorboard"])
        if wandb is not None:
            self.wandb_monitor = WandbMonitor(sections["wandb"], wandb)
        if sections["csv_monitor"].enabled:
            self.csv_monitor = CsvMonitor(sections["csv_monitor"])
        if comet_ml is not None:
            self.comet_monitor = CometMonitor(sections["comet"], comet_ml)

    def _monitors(self) -> list:
        return [m for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor)
                if m is not None]

    def write_events(self, event_list: Sequence[Event]) -> None:
        """Write ``[(tag, value, step), ...]`` to every enabled monitor (global rank 0; a no-op elsewhere)."""
        if self._closed:
            raise RuntimeError("hf_zero: engine.monitor.write_events() after engine.destroy() closed the monitor; "
                               "write the events before destroying the engine")
        for monitor in self._monitors():
            monitor.write_events(event_list)

    def close(self) -> None:
        """Close the writers (``engine.destroy()`` calls it). Idempotent."""
        if not self._closed:
            self._closed = True
            for monitor in self._monitors():
                monitor.close()
