"""Which device this process trains on: DeepSpeed's rule, decided in one place.

DeepSpeed's engine moves the model to ``cuda:LOCAL_RANK`` (and makes it the current device) whatever device the
model was built on; scripts rely on it (they build the model on the CPU, hand it to ``initialize`` and feed the
engine batches moved to ``engine.device`` / ``engine.local_rank``). hf_zero does the same:

* no usable GPU, or ``DS_ACCELERATOR=cpu`` (DeepSpeed's switch to its CPU accelerator): the CPU;
* a current device chosen by the script (``torch.cuda.set_device(i)`` with ``i != 0`` before ``initialize``): that
  one -- the script said where it wants to run;
* else ``cuda:LOCAL_RANK``; one visible GPU per process (a launcher that sets ``CUDA_VISIBLE_DEVICES`` per rank)
  means ``cuda:0`` whatever the local rank. A local rank with no GPU of its own is an error naming both numbers,
  never two ranks silently sharing a GPU.

The answer is made the current CUDA device, so every later allocation without an explicit device (NCCL's, the
compiled kernels') lands there too.
"""

from __future__ import annotations

import os

import torch

__all__ = ["local_device", "accelerator_type", "accelerator_device", "ACCELERATOR_ENV"]

ACCELERATOR_ENV = "DS_ACCELERATOR"  # DeepSpeed's variable: "cpu" trains on the CPU even where a GPU is visible


def accelerator_type() -> str:
    """``"cuda"`` when this process trains on a GPU, else ``"cpu"`` (see the module docstring)."""
    forced = os.environ.get(ACCELERATOR_ENV, "").strip().lower()
    if forced == "cpu":
        return "cpu"
    if forced not in ("", "cuda"):
        raise ValueError(f"hf_zero: {ACCELERATOR_ENV}={os.environ[ACCELERATOR_ENV]!r} is not supported; hf_zero "
                         "trains on 'cuda' or 'cpu' (unset it to pick the GPU when one is visible)")
    return "cuda" if torch.cuda.is_available() else "cpu"


def accelerator_device() -> torch.device | None:
    """The GPU this process computes on (the current CUDA device, chosen by :func:`local_device`) when it trains on
    one; None on a CPU run. Where ZeRO-3 puts gathered parameters, whatever device their shards live on."""
    return torch.device("cuda", torch.cuda.current_device()) if accelerator_type() == "cuda" else None


def local_device() -> torch.device:
    """The device this process trains on, made current (see the module docstring)."""
    if accelerator_type() == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    current = torch.cuda.current_device()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if current != 0:  # the script chose its device before initialize
        index = current
    elif count == 1:
        index = 0
    elif local_rank < count:
        index = local_rank
    else:
        raise RuntimeError(f"hf_zero: LOCAL_RANK={local_rank} but this process sees {count} GPUs "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); launch at "
                           "most one process per visible GPU, or call torch.cuda.set_device() before initialize")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
