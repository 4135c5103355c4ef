"""A rank that takes another path through a ZeRO-3 model gets an error naming the module and the ranks, fast."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hf_zero.testing import run_distributed

from _zero3_util import make_runtime

TIMEOUT_S = 2.0


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.swap_on_rank: int | None = None
        self.skip_first_on_rank: int | None = None

    def forward(self, x):
        rank = dist.get_rank()
        if rank == self.skip_first_on_rank:
            return self.second(x)
        if rank == self.swap_on_rank:
            return self.first(self.second(x))
        return self.second(self.first(x))


def _step(model, rt, x):
    model(x).sum().backward()
    rt.finish_backward()
    rt.after_step()


def _first_step_skip():
    """First step, default settings: rank 1 skips a module. The check before every collective catches it before
    the payload of another size is issued."""
    from hf_zero.zero.stage3 import DivergenceError

    x = torch.ones(2, 8)
    torch.manual_seed(0)
    model = _TwoLayers()
    model.skip_first_on_rank = 1
    rt = make_runtime(model, param_persistence_threshold=0, divergence_timeout_s=TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(DivergenceError) as info:
        _step(model, rt, x)
    return str(info.value), time.monotonic() - t0


def _later_step_swap_without_checks(defer: bool = False):
    """comms_divergence_check off, later step, same-size gathers in another order: the trailer inside the gathered
    data catches it with no extra collective. ``defer``: as on a GPU, the trailers of gathers whose header was
    checked are set aside and checked at the end of the pass (Gatherer.check_deferred: no host sync per gather);
    those of the unchecked steady state still at once, or the diverged ranks would go on into unmatched
    collectives."""
    from hf_zero.comm import faults
    from hf_zero.zero.stage3 import DivergenceError

    faults.configure(divergence_check=False)
    x = torch.ones(2, 8)
    torch.manual_seed(0)
    model = _TwoLayers()
    rt = make_runtime(model, param_persistence_threshold=0, divergence_timeout_s=TIMEOUT_S, prefetch_bucket_size=0)
    rt.gatherer.defer_trailer_checks = defer
    _step(model, rt, x)
    checked = rt.gatherer.deferred_trailer_checks
    headers = rt.gatherer.header_check_count
    model.swap_on_rank = 1
    with pytest.raises(DivergenceError) as info:
        _step(model, rt, x)
    assert rt.gatherer.header_check_count == headers  # the steady state sent no header collective
    return str(info.value), checked


def test_divergence_is_an_error_naming_module_and_ranks():
    for rank, (text, seconds) in enumerate(run_distributed(_first_step_skip, 2, timeout_s=120)):
        assert "module 'first'" in text and "module 'second'" in text, text
        assert "rank 0: the gather of module 'first'" in text and "rank 1: the gather of module 'second'" in text
        assert seconds < 2 * TIMEOUT_S
    for defer in (False, True):
        for text, checked in run_distributed(_later_step_swap_without_checks, 2, args=(defer,), timeout_s=120):
            assert "'first'" in text and "'second'" in text and "ranks [0]" in text and "ranks [1]" in text, text
            # the healthy first step, recorded with headers: its gathers (two modules forward, two backward)
            # checked at the end of forward and of backward
            assert checked == (4 if defer else 0), (defer, checked)
