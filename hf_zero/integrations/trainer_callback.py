"""``HfZeroCallback``: what the ZeRO engine knows, in the Trainer's logs and next to every saved model.

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    HfZeroCallback.attach(trainer)          # or Trainer(..., callbacks=[HfZeroCallback()])
    trainer.train()

At every logging step it adds two figures to the Trainer's logs (``trainer.state.log_history`` and every callback
after it; with :meth:`attach` it runs before them, so ``report_to`` integrations see them too), so the line a user
reads stays at six figures beside the Trainer's loss, grad_norm, learning_rate and epoch -- three on a GPU whose
peak is known:

- ``zero/tokens_per_s``: tokens (from the attention mask) trained per second since the previous log, all ranks;
- ``zero/peak_mem_gb``: the largest peak memory of any rank so far, GiB (CUDA: ``max_memory_allocated``; CPU:
  peak RSS);
- ``zero/mfu``, only where the device's dense peak FLOP/s is known (a GPU, see below): the model FLOPs per second
  per rank as a share of that peak, the figure a GPU user compares runs by. A CPU has no such figure.

``HfZeroCallback(detail=True)`` (or ``HF_ZERO_LOG_DETAIL=1``) adds the full detail, for diagnosing a run:

- ``zero/peak_mem_mb/max`` and ``zero/peak_mem_mb/min``: the largest and smallest rank's peak, MiB;
- ``zero/tokens_per_s_per_rank``; ``zero/model_tflops_per_rank``, and where the device's dense peak is known
  (``zero/peak_tflops``, overridable with ``HfZeroCallback(peak_tflops=...)`` or ``HF_ZERO_PEAK_TFLOPS``)
  ``zero/mfu`` and ``zero/hfu``: model FLOPs per second per rank (analytic, checked against a dispatcher count; see
  hf_zero/integrations/throughput.py) and their share of that peak, without and with recompute. On a device with no
  known peak there is no MFU rather than a guess;
- ``zero/grad_norm`` (the engine's global norm before clipping, the Trainer's ``grad_norm``), ``zero/loss_scale``
  and ``zero/skipped_steps`` (fp16's scale and the steps it skipped; 1.0 and 0 otherwise);
- ``zero/time_share/<phase>`` for forward, backward, step and other (data loading, the Trainer's own work): shares
  of the wall-clock time since the previous log, which sum to 1;
- ``zero/time_within/<phase>``: time blocked in communication (gradient reductions, ZeRO-3 gathers) or offload
  I/O, as a share of the same window. It is spent *inside* forward, backward or step, so it overlaps those shares
  and is not part of their sum.

With :meth:`attach`, the Trainer's ``total_flos`` counts the model's true parameters (transformers counts the local
ZeRO-3 shard), so it is the same at every stage.

On every checkpoint save and at the end of training it writes a model card (``templates/model_card.md`` beside
this file, shipped in the wheel as package data) into the saved directory, describing the ZeRO configuration,
precision and hardware; :func:`write_model_card` does the same for any directory (e.g. after
``trainer.save_model(dir)``).

Memory figures are gathered from all ranks in ``on_step_end``, which every rank runs at every optimizer step, never
in ``on_log`` (which user code may call on one rank only), so the callback cannot cause a collective hang.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import string
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_zero.config.boolean import truthy

__all__ = ["HfZeroCallback", "write_model_card", "peak_memory_mb", "time_shares", "CARD_BEGIN", "CARD_END",
           "DETAIL_ENV"]

CARD_TEMPLATE = Path(__file__).resolve().parent / "templates" / "model_card.md"
CARD_BEGIN = "<!-- hf_zero:training -->"
CARD_END = "<!-- /hf_zero:training -->"
_STAGE_MEANING = {0: "plain data parallelism", 1: "optimizer states sharded", 2: "optimizer states and gradients "
                  "sharded", 3: "optimizer states, gradients and parameters sharded"}


def peak_memory_mb(device: torch.device | None = None) -> float:
    """This process's peak memory in MiB: CUDA allocator peak on a GPU, peak resident set size on CPU."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


DETAIL_ENV = "HF_ZERO_LOG_DETAIL"
# The engine's top-level phases: consecutive, never nested in one another. Every other timed phase (communication,
# offload_io) is time blocked inside one of them.
TOP_PHASES = ("forward", "backward", "step")


def time_shares(seconds: dict[str, float], wall: float) -> dict[str, float]:
    """Shares of ``wall`` seconds: the top-level phases plus ``other`` (summing to 1), and the nested phases as
    ``zero/time_within/<phase>`` (overlapping the top-level ones; see the module docstring)."""
    wall = max(wall, 1e-9)
    shares = {p: min(max(seconds.get(p, 0.0) / wall, 0.0), 1.0) for p in TOP_PHASES}
    scale = min(1.0, 1.0 / sum(shares.values())) if sum(shares.values()) > 0 else 1.0  # timer jitter past 100%
    out = {f"zero/time_share/{p}": round(v * scale, 4) for p, v in shares.items()}
    out["zero/time_share/other"] = round(max(0.0, 1.0 - sum(out.values())), 4)
    for phase, s in seconds.items():
        if phase not in TOP_PHASES:
            out[f"zero/time_within/{phase}"] = round(min(max(s / wall, 0.0), 1.0), 4)
    return out


def _engine_of(obj: Any):
    """The hf_zero engine behind a Trainer (``model_wrapped``) or the engine itself; None for non-ZeRO runs."""
    from hf_zero.runtime.engine import HfZeroEngine

    if isinstance(obj, HfZeroEngine):
        return obj
    wrapped = getattr(obj, "model_wrapped", None)
    return wrapped if isinstance(wrapped, HfZeroEngine) else None


class HfZeroCallback(TrainerCallback):
    """Adds ZeRO engine statistics to the Trainer's logs and writes a model card next to saved models."""

    def __init__(self, write_cards: bool = True, peak_tflops: float | None = None, detail: bool | None = None):
        self.write_cards = write_cards
        self.peak_tflops = peak_tflops
        self.detail = (os.environ.get(DETAIL_ENV, "0").strip() not in ("", "0")) if detail is None else bool(detail)
        self._meter = None                # ThroughputMeter, from on_train_begin
        self._throughput_mark = 0.0
        self._trainer = None
        self._pending: dict[str, float] = {}
        self._phase_mark: tuple[float, dict[str, float]] | None = None

    @classmethod
    def attach(cls, trainer, **kwargs) -> "HfZeroCallback":
        """Add the callback to ``trainer`` right after ``DefaultFlowCallback`` (which decides when to log) and
        ahead of the reporting integrations (so they log its values)."""
        from transformers.trainer_callback import DefaultFlowCallback

        from hf_zero.integrations.throughput import true_floating_point_ops

        callback = cls(**kwargs)
        callback._trainer = trainer
        trainer.floating_point_ops = true_floating_point_ops(trainer.model)
        callbacks = trainer.callback_handler.callbacks
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        callbacks.insert(flow[0] + 1 if flow else 0, callback)
        return callback

    # ---- where the engine comes from --------------------------------------------------------------------------
    def _engine(self, kwargs: dict):
        if self._trainer is not None:
            return _engine_of(self._trainer)
        # Without attach(): the optimizer the Trainer hands to callbacks wraps the engine's optimizer.
        return None

    def _optimizer(self, kwargs: dict):
        engine = self._engine(kwargs)
        if engine is not None:
            return engine.optimizer
        opt = kwargs.get("optimizer")
        inner = getattr(opt, "optimizer", None)  # accelerate's DeepSpeedOptimizerWrapper
        return inner if hasattr(inner, "global_grad_norm") else None

    # ---- callbacks ----------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        from hf_zero.integrations.throughput import ThroughputMeter

        engine = self._engine(kwargs)
        if engine is not None and self.detail:  # (phase timing costs a clock read per phase: detail only)
            self._phase_mark = (time.perf_counter(), engine.phase_seconds_total())
        model = kwargs.get("model")
        called = engine if engine is not None else getattr(self._trainer, "model_wrapped", None) or model
        if isinstance(called, torch.nn.Module) and self._meter is None:
            self._meter = ThroughputMeter(called, getattr(model, "config", None))
        self._throughput_mark = time.perf_counter()

    def _throughput(self, args, engine, gathered: list) -> dict[str, float]:
        now = time.perf_counter()
        wall = max(now - self._throughput_mark, 1e-9)
        self._throughput_mark = now
        world = len(gathered)
        tokens = sum(g[1] for g in gathered)
        stats = {"zero/tokens_per_s": round(tokens / wall, 2),
                 "zero/tokens_per_s_per_rank": round(tokens / wall / world, 2)}
        if not all(g[2] > 0 for g in gathered):
            return stats
        model_tflops = sum(g[2] for g in gathered) / world / wall / 1e12
        hardware_tflops = sum(g[3] for g in gathered) / world / wall / 1e12
        stats["zero/model_tflops_per_rank"] = _sig(model_tflops)
        from hf_zero.profiling.hardware import peak_tflops

        if engine is not None:
            dtype = engine.compute_dtype
        else:
            dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
        peak = peak_tflops(getattr(args, "device", None), dtype, override=self.peak_tflops)
        if peak:
            stats["zero/peak_tflops"] = peak
            stats["zero/mfu"] = _sig(model_tflops / peak)
            stats["zero/hfu"] = _sig(hardware_tflops / peak)
        return stats

    def on_step_end(self, args, state, control, **kwargs):
        if not control.should_log:
            return
        stats: dict[str, float] = {}
        device = args.device if hasattr(args, "device") else None
        # (peak MiB, tokens, model FLOPs, hardware FLOPs) of this rank since the previous log
        mine = (peak_memory_mb(device), *(self._meter.take() if self._meter is not None else (0, 0.0, 0.0)))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        peaks = [float(figures[0]) for figures in gathered]
        throughput = self._throughput(args, self._engine(kwargs), gathered) if self._meter is not None else {}
        if not self.detail:  # the figures of the default line (module docstring)
            for key in ("zero/tokens_per_s", "zero/mfu"):
                if key in throughput:
                    stats[key] = throughput[key]
            stats["zero/peak_mem_gb"] = round(max(peaks) / 1024, 3)
            self._pending = stats
            return
        stats["zero/peak_mem_mb/max"] = round(max(peaks), 1)
        stats["zero/peak_mem_mb/min"] = round(min(peaks), 1)
        stats.update(throughput)

        optimizer = self._optimizer(kwargs)
        if optimizer is not None:
            norm = optimizer.global_grad_norm
            if norm is not None:
                stats["zero/grad_norm"] = float(norm)
            scaler = getattr(optimizer, "loss_scaler", None)
            stats["zero/loss_scale"] = float(scaler.scale) if scaler is not None else 1.0
            stats["zero/skipped_steps"] = int(optimizer.skipped_steps)

        engine = self._engine(kwargs)
        if engine is not None and self._phase_mark is not None:
            now, totals = time.perf_counter(), engine.phase_seconds_total()
            then, before = self._phase_mark
            stats.update(time_shares({k: v - before.get(k, 0.0) for k, v in totals.items()}, now - then))
            self._phase_mark = (now, totals)
        self._pending = stats

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._pending or logs is None or "loss" not in logs:
            return
        logs.update(self._pending)
        # Trainer.log appended a copy of ``logs`` to the history just before calling us
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        self._pending = {}

    def on_save(self, args, state, control, **kwargs):
        if self.write_cards and state.is_world_process_zero:
            directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if directory.is_dir():
                write_model_card(directory, self._trainer or kwargs, state=state)

    def on_train_end(self, args, state, control, **kwargs):
        if self._meter is not None:
            self._meter.remove()
            self._meter = None
        if self.write_cards and state.is_world_process_zero and Path(args.output_dir).is_dir():
            write_model_card(args.output_dir, self._trainer or kwargs, state=state)


def _sig(x: float) -> float:
    """Six significant digits (an MFU of 3e-7 on a CPU must not round to 0)."""
    return float(f"{x:.6g}")


def _hardware() -> str:
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        per_node = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
        return f"{per_node} per node (CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
        cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    return f"CPU only: {cpu}, {os.cpu_count()} cores per node"


def _accelerate_deepspeed_config() -> dict:
    """The DeepSpeed config accelerate handed the engine ({} when the run does not use one)."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return {}
    plugin = AcceleratorState().deepspeed_plugin
    return dict(plugin.deepspeed_config) if plugin is not None else {}


def write_model_card(directory, source: Any, state=None) -> Path:
    """Write the hf_zero training card into ``directory/README.md`` (rank 0 only; returns the path).

    ``source`` is a Trainer or an hf_zero engine; for anything else the config comes from accelerate's state.
    An existing README keeps its content: hf_zero's section (between ``CARD_BEGIN``/``CARD_END``) is replaced or appended.
    """
    import transformers

    from hf_zero import __version__

    engine = _engine_of(source)
    if state is None:
        state = getattr(source, "state", None)
    config = dict(engine.config) if engine is not None else _accelerate_deepspeed_config()
    zero = config.get("zero_optimization", {})
    zero_run = bool(config)
    stage = int(zero.get("stage", 0))
    if truthy(config.get("fp16", {}).get("enabled")):
        precision = "fp16 mixed precision (fp32 master weights)"
    elif truthy(config.get("bf16", config.get("bfloat16", {})).get("enabled")):
        precision = "bf16 mixed precision (fp32 master weights)"
    else:
        precision = "fp32"
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    losses = [e["loss"] for e in getattr(state, "log_history", []) if "loss" in e]
    values = {
        "stage": stage if zero_run else "none",
        "stage_meaning": _STAGE_MEANING.get(stage, "") if zero_run else "not trained by the ZeRO engine",
        "world_size": world,
        "precision": precision,
        "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device", "none"),
        "offload_param": (zero.get("offload_param") or {}).get("device", "none"),
        "micro_batch": config.get("train_micro_batch_size_per_gpu", "?"),
        "grad_accum": config.get("gradient_accumulation_steps", "?"),
        "global_batch": config.get("train_batch_size", "?"),
        # an absent key clips at 1.0 (hf_zero's and DeepSpeed's default); 0 is off
        "gradient_clipping": config.get("gradient_clipping", 1.0 if zero_run else "none") or "none",
        "global_step": getattr(state, "global_step", "?"),
        "last_loss": f"{losses[-1]:.4f}" if losses else "n/a",
        "hardware": _hardware(),
        "hf_zero_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "config_json": json.dumps(config, indent=2, sort_keys=True, default=str),
    }
    section = f"{CARD_BEGIN}\n{string.Template(CARD_TEMPLATE.read_text()).substitute(values).strip()}\n{CARD_END}\n"
    path = Path(directory) / "README.md"
    if path.exists():
        text = path.read_text()
        if CARD_BEGIN in text and CARD_END in text:
            head, rest = text.split(CARD_BEGIN, 1)
            text = head + section + rest.split(CARD_END, 1)[1].lstrip("\n")
        else:
            text = text.rstrip("\n") + "\n\n" + section
    else:
        text = section
    path.write_text(text)
    return path
