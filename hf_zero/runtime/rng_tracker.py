"""Named random-number streams for model-parallel code: Megatron's and DeepSpeed's ``CudaRNGStatesTracker``.

    tracker = get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", seed)      # a stream of its own, seeded once
    with tracker.fork():                          # dropout inside draws from that stream ...
        out = torch.nn.functional.dropout(x, 0.1)
    # ... and the default generator is where it was before the block

Tensor-parallel ranks must draw *different* dropout masks inside their shard of a layer but the *same* ones
outside it. The tracker keeps one generator state per name and swaps it into the device's default generator for
the duration of ``fork``. The device is the accelerator's (:func:`hf_zero.comm.accelerator.get_accelerator`): the
current CUDA device's generator on a GPU machine, torch's CPU generator otherwise -- so the same script runs, and
draws reproducibly, on both.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from hf_zero.comm.accelerator import get_accelerator

__all__ = ["CudaRNGStatesTracker", "MODEL_PARALLEL_RNG", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
           "model_parallel_reconfigure_tp_seed"]

logger = logging.getLogger("hf_zero")

MODEL_PARALLEL_RNG = "model-parallel-rng"  # the stream Megatron's tensor-parallel layers fork by default
_MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's and DeepSpeed's: model-parallel seed = seed + 2718 + tp_rank


class CudaRNGStatesTracker:
    """Generator states by name (DeepSpeed's and Megatron's class and method names, so scripts keep working).

    ``get_states`` returns a shallow copy of the name -> state dict and ``set_states`` installs a dict as given:
    activation checkpointing snapshots the states before a forward and re-installs them for the recomputation.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every stream and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` starting from ``seed``; the default generator is left as it was."""
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another stream")
        if name in self.states_:
            raise ValueError(f"RNG tracker: a stream named {name!r} already exists; reset() the tracker first")
        self.seeds_.add(seed)
        accelerator = get_accelerator()
        outer = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states_[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; it advances, and the default generator is restored after."""
        if name not in self.states_:
            raise ValueError(f"RNG tracker: no stream named {name!r} (known: {sorted(self.states_)}); add(name, "
                             "seed) it first, or call model_parallel_cuda_manual_seed(seed)")
        accelerator = get_accelerator()
        outer = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(outer)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's one tracker (activation checkpointing saves and restores its states)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, *, tp_rank: int = 0, dp_rank: int = 0, global_rank: int = 0) -> None:
    """Seed the default generator with ``seed`` (the same on every tensor-parallel rank of a data-parallel
    replica) and the tracker's :data:`MODEL_PARALLEL_RNG` stream with ``seed + 2718 + tp_rank`` (different on
    each tensor-parallel rank), as Megatron and DeepSpeed do. Resets the tracker first."""
    model_parallel_seed = seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank
    if global_rank == 0:
        logger.info("> initializing model parallel seeds on global rank %d, model parallel rank %d, and data "
                    "parallel rank %d with model parallel seed: %d and data parallel seed: %d",
                    global_rank, tp_rank, dp_rank, model_parallel_seed, seed)
    _TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, model_parallel_seed)


def model_parallel_reconfigure_tp_seed(seed: int, *, tp_rank: int = 0) -> None:
    """Re-seed the existing :data:`MODEL_PARALLEL_RNG` stream for ``tp_rank`` (after a change of tensor-parallel
    layout, e.g. loading a universal checkpoint)."""
    with _TRACKER.fork():
        get_accelerator().manual_seed(seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)
