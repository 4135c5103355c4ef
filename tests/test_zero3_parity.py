"""ZeRO-3 parity: a tiny Llama built under zero.Init and trained through the Stage3Runtime contract on 4 ranks
matches one process (see _zero3_util.init_model_parity)."""

from __future__ import annotations

from hf_zero.testing import run_distributed

from _zero3_util import STEPS, init_model_parity


def test_init_model_parity_4_ranks():
    """The 2-rank run of the same check is part of test_zero3_features (one spawn for many checks)."""
    losses = run_distributed(init_model_parity, 4, args=(STEPS,), timeout_s=180)
    assert all(l == losses[0] for l in losses) and len(losses[0]) == STEPS
