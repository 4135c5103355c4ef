"""``set_random_seed``: DeepSpeed's one call that seeds every generator a training script draws from."""

from __future__ import annotations

import random

import numpy
import torch

__all__ = ["set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every GPU)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
