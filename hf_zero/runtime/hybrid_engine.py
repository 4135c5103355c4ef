"""DeepSpeed's hybrid engine (the ``hybrid_engine`` config section): the training engine also generates.

RLHF scripts (DeepSpeed-Chat's step 3) train the actor with the engine and sample rollouts from the same model
between steps: ``actor.eval()``, ``actor.module.generate(...)``, ``actor.train()``, backward, step. Under ZeRO-3 a
plain ``generate`` gathers every layer's parameters at every decoding step -- a whole-model all-gather per token.
With ``hybrid_engine.enabled``, as in DeepSpeed:

- ``module.generate`` (and so ``engine.generate``) runs with every parameter gathered once for the call
  (``pin_parameters``, default true; :func:`hf_zero.zero.gathered.unwrap_model_for_generation`: the module hooks
  are off for the call) -- the decoding steps then run as on an unpartitioned model. ``pin_parameters: false``
  keeps the layer-by-layer gathers (less memory, DeepSpeed's unpinned mode). At stages 0-2 nothing is partitioned
  and the call is the model's own.
- At start every rank takes global rank 0's random-number state (DeepSpeed syncs the accelerator's), so sampling
  with the same inputs draws the same tokens on every rank.
- ``engine.eval()`` after a round logs DeepSpeed's latency breakdown on rank 0 (end-to-end, gather, generate,
  training, others, samples/s), with the figures measured here.

What DeepSpeed adds beyond that is its inference-kernel injection for the model families it has policies for
(BLOOM, GPT-J/NeoX, Llama, OPT with transformers < 4.56, ...) with tensor-parallel generation
(``inference_tp_size``), a kernel workspace (``max_out_tokens``, ``release_inference_cache``), CUDA graphs and LoRA
fusion into those kernels. hf_zero generates with the model's own forward -- as DeepSpeed itself does for a model
without a policy -- so those keys warn or have no effect (hf_zero/config/status.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from hf_zero import comm
from hf_zero.zero.gathered import unwrap_model_for_generation

__all__ = ["HybridGeneration", "sync_rng_from_rank0"]

logger = logging.getLogger(__name__)


def sync_rng_from_rank0(device: torch.device) -> None:
    """Every rank takes global rank 0's random-number state: the accelerator's on a GPU, the CPU generator's on
    the CPU (DeepSpeed's ``get_accelerator().get_rng_state()`` is the CPU one there). A collective over the world."""
    if comm.get_world_size() == 1:
        return
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    # NCCL broadcasts device tensors only; the state is a small byte tensor either way
    buf = state.to(device) if cuda else state.clone()
    comm.broadcast(buf, src=0)
    if cuda:
        torch.cuda.set_rng_state(buf.cpu(), device)
    else:
        torch.set_rng_state(buf)


class HybridGeneration:
    """Owns the engine's generation mode: the wrapped ``module.generate`` and the round timers. One per engine
    with ``hybrid_engine.enabled``; :meth:`close` puts the model's own ``generate`` back."""

    def __init__(self, engine: nn.Module, config: Any) -> None:
        self._engine = engine
        self._config = config
        self._module = engine.module
        self._own_generate = self._module.__dict__.get("generate")  # an instance attribute to restore, if any
        self._generate = getattr(self._module, "generate", None)
        if self._generate is not None:
            self._module.generate = self.generate
        sync_rng_from_rank0(engine.device)
        self._total_batch_size: int | None = None
        self._round_start: float | None = None  # the previous eval()
        self._total_latency = 0.0
        self._rounds = 0
        self._train_start: float | None = None
        self.gather_seconds = 0.0
        self.generate_seconds = 0.0
        self.training_seconds = 0.0  # since the last eval(): train() to each step()

    @property
    def gathers_once(self) -> bool:
        """ZeRO-3 with ``pin_parameters``, outside the script's own ``unwrap_model_for_generation`` block (which
        already holds everything gathered): generate() gathers the whole model once."""
        runtime = self._engine.stage3
        return runtime is not None and self._config.pin_parameters and not runtime.hooks_suspended

    def generate(self, *args, **kwargs):
        """The model's ``generate``; under ZeRO-3 with ``pin_parameters`` with every parameter gathered once for
        the call (a collective on entry and exit: every rank calls it, as ``synced_gpus`` generation needs anyway)."""
        if self._generate is None:
            raise AttributeError(f"hf_zero hybrid_engine: {type(self._module).__name__} has no generate()")
        if self._total_batch_size is None:
            ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
            if isinstance(ids, torch.Tensor):
                self._total_batch_size = ids.shape[0] * comm.get_world_size(self._engine.process_group)
        start = time.perf_counter()
        if self.gathers_once:
            with unwrap_model_for_generation(self._engine):
                self.gather_seconds = time.perf_counter() - start
                out = self._generate(*args, **kwargs)
        else:
            self.gather_seconds = 0.0
            out = self._generate(*args, **kwargs)
        self.generate_seconds = time.perf_counter() - start - self.gather_seconds
        return out

    def before_eval(self) -> None:
        """``engine.eval()``: closes the round begun at the previous eval() and logs its breakdown (rank 0)."""
        now = time.perf_counter()
        if self._round_start is not None:
            latency = max(now - self._round_start, 1e-9)
            self._total_latency += latency
            self._rounds += 1
            if comm.get_rank() == 0:
                logger.info("hf_zero hybrid engine: %s", self._breakdown(latency))
        self._round_start = now
        self.training_seconds = 0.0

    def after_train(self) -> None:
        """``engine.train()``: training time counts from here to each step()."""
        self._train_start = time.perf_counter()

    def after_step(self) -> None:
        if self._train_start is not None:
            now = time.perf_counter()
            self.training_seconds += now - self._train_start
            self._train_start = now

    def _breakdown(self, latency: float) -> str:
        # DeepSpeed's line (runtime/hybrid_engine.py, eval()), same fields and order
        others = latency - (self.generate_seconds + self.training_seconds)
        parts = [f"|E2E latency={latency:.2f}s ",
                 f"|Gather latency={self.gather_seconds:.2f}s ({self.gather_seconds / latency * 100:.2f}%) ",
                 f"|Generate time={self.generate_seconds:.2f}s ({self.generate_seconds / latency * 100:.2f}%) ",
                 f"|Training time={self.training_seconds:.2f}s ({self.training_seconds / latency * 100:.2f}%) ",
                 f"|Others={others:.2f} ({others / latency * 100:.2f}%)"]
        if self._total_batch_size is not None:
            parts += [f"|CurSamplesPerSec={self._total_batch_size / latency:.2f} ",
                      f"|AvgSamplesPerSec={self._total_batch_size / (self._total_latency / self._rounds):.2f}"]
        return "".join(parts)

    def close(self) -> None:
        """Give the model its own ``generate`` back."""
        if self._generate is None or self._module.__dict__.get("generate") != self.generate:
            return
        if self._own_generate is not None:
            self._module.generate = self._own_generate
        else:
            del self._module.generate
        self._generate = None
