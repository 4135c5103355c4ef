"""Stages whose compute time is controlled, shared by bench_pipeline.py (hf_zero, raw torch) and its DeepSpeed
worker (which runs in DeepSpeed's own virtual environment and must not import hf_zero).

A layer's forward sleeps t_f and its backward 2 t_f inside an autograd Function, so the compute does not take the
loaded machine's cores. ``BUSY`` accumulates the wall time actually spent in those sleeps on this process (a sleep
overshoots its request on a loaded machine): the measured bubble is 1 - busy / step time, so an overshoot counts as
compute, as it would on a stage whose kernels ran slower, and not as pipeline overhead.
"""

from __future__ import annotations

import time

import torch
from torch import nn

WIDTH, MICRO = 8, 2
BUSY = [0.0]  # seconds spent computing on this process since it started


def _busy_sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    BUSY[0] += time.perf_counter() - start


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds_fwd, seconds_bwd):
        _busy_sleep(seconds_fwd)
        ctx.seconds_bwd = seconds_bwd
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _busy_sleep(ctx.seconds_bwd)
        return grad, None, None


class SleepLayer(nn.Module):
    """A tiny linear layer whose forward takes t_f and backward 2 t_f of wall time."""

    def __init__(self, tf: float):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.tf = tf

    def forward(self, x):
        return _Sleep.apply(self.linear(x), self.tf, 2 * self.tf)


def batches(m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's m micro-batches (inputs, targets), the same in every framework."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, MICRO, WIDTH, generator=g), torch.randn(m, MICRO, WIDTH, generator=g)
