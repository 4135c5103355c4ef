"""The deterministic pieces both sides of the TiledLinear fixture build: tests/data/tiling/make_fixture.py (with real
DeepSpeed) records DeepSpeed's outputs on them, tests/test_zero_tiling.py rebuilds them for hf_zero's. Imports no
DeepSpeed and no hf_zero."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BiasSkippingLinear(torch.nn.Linear):
    """A Megatron-style tile (``skip_bias_add``): returns ``(x @ W.T, bias)``; TiledLinearReturnBias needs pairs."""

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


def weights(in_features: int, out_features: int, bias: bool) -> torch.nn.Linear:
    """A Linear with values fixed by its shape (no RNG), so the test can rebuild it."""
    lin = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        n = out_features * in_features
        lin.weight.copy_(torch.sin(torch.arange(n, dtype=torch.float32) * 0.37).reshape(out_features, in_features))
        if bias:
            lin.bias.copy_(torch.cos(torch.arange(out_features, dtype=torch.float32) * 0.61))
    return lin


def inputs(in_features: int) -> torch.Tensor:
    return torch.cos(torch.arange(2 * 3 * in_features, dtype=torch.float32) * 0.23).reshape(2, 3, in_features)
