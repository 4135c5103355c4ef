"""``transformers.TrainerCallback`` that drives compression during ``Trainer.train()``.

- before every optimizer step: the schedules move to ``state.global_step`` (bits, densities, start offsets);
- on every log: current bits / kept shares / measured weight sparsity are added to the logged metrics;
- at the end of training, with ``clean_at_end=True``: :func:`redundancy_clean` makes the model smaller in place.

Nothing is kept in the callback: every mask, bit width and density is a buffer of the model, so it is in each
checkpoint, and a run resumed with ``trainer.train(resume_from_checkpoint=...)`` continues the schedule where it
stopped (the callback only re-reads ``state.global_step``).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from .compress import CompressionScheduler, load_compression_config, redundancy_clean

__all__ = ["CompressionCallback"]


class CompressionCallback(TrainerCallback):
    def __init__(self, config: Any, clean_at_end: bool = False, log_stats: bool = True):
        """``config``: the DeepSpeed config (dict or JSON path) or its ``compression_training`` section -- the
        one given to ``init_compression``."""
        self.config = load_compression_config(config)
        self.clean_at_end = clean_at_end
        self.log_stats = log_stats
        self.cleaned = False

    def _scheduler(self, model) -> CompressionScheduler:
        return CompressionScheduler(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._scheduler(model).step(state.global_step)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._scheduler(model).step(state.global_step)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if not self.log_stats or logs is None or model is None or self.cleaned:
            return
        stats = self._scheduler(model).stats()
        logs.update(stats)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(stats)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.clean_at_end and model is not None and not self.cleaned:
            redundancy_clean(model, self.config)
            self.cleaned = True
