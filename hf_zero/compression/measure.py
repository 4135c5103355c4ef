"""What a compressed model is judged by: bytes on disk, CPU latency, perplexity. Used by the benchmark, the
examples and the model card, so all three report the same quantities the same way."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Sequence

import torch
from torch import nn

__all__ = ["size_on_disk", "cpu_latency", "perplexity"]


def size_on_disk(model: nn.Module) -> int:
    """Bytes of the model's state dict written as one safetensors file (shared tensors stored once)."""
    from safetensors.torch import save_model

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_model(model, path)
        return os.path.getsize(path)


@torch.inference_mode()
def cpu_latency(models: Sequence[nn.Module], input_ids: torch.Tensor, repeats: int = 15,
                warmup: int = 2) -> list[float]:
    """Median seconds of one forward pass of each model on ``input_ids`` (B, T). The models are timed
    interleaved, round by round, so load from other processes on a shared machine hits all of them alike."""
    for model in models:
        model.eval()
        for _ in range(warmup):
            model(input_ids)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for i, model in enumerate(models):
            start = time.perf_counter()
            model(input_ids)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


@torch.inference_mode()
def perplexity(model: nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) over ``blocks`` (N, T) of token ids."""
    model.eval()
    nll, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch_size):
        ids = blocks[i:i + batch_size]
        logits = model(ids).logits[:, :-1].float()
        target = ids[:, 1:]
        nll += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                       reduction="sum"))
        count += target.numel()
    return float(torch.exp(torch.tensor(nll / count)))
