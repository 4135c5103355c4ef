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


def _divergence_scenarios():
    from hf_zero.zero.stage3 import DivergenceError

    rank = dist.get_rank()
    x = torch.ones(2, 8)
    messages = {}

    # 1. First step: rank 1 skips a module. The gathers differ in which parameters they carry; the header that
    #    precedes every gather of the recorded first iteration catches it before the payload collective.
    torch.manual_seed(0)
    model = _TwoLayers()
    model.skip_first_on_rank = 1
    rt = make_runtime(model, param_persistence_threshold=0, divergence_timeout_s=TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(DivergenceError) as info:
        _step(model, rt, x)
    messages["first_step"] = (str(info.value), time.monotonic() - t0)
    rt.remove()

    # 2. Later step, same-size gathers in a different order: the trailer inside the gathered data catches it
    #    with no extra collective.
    torch.manual_seed(0)
    model = _TwoLayers()
    rt = make_runtime(model, param_persistence_threshold=0, divergence_timeout_s=TIMEOUT_S, prefetch_bucket_size=0)
    _step(model, rt, x)
    headers = rt.gatherer.header_check_count
    model.swap_on_rank = 1
    with pytest.raises(DivergenceError) as info:
        _step(model, rt, x)
    assert rt.gatherer.header_check_count == headers  # the steady state sent no header collective
    messages["trailer"] = (str(info.value), 0.0)
    model.swap_on_rank = None
    rt._reset_gathered()

    # 3. Later step, rank 1 never joins (it skipped the step): rank 0 times out and is told where rank 1 is.
    t0 = time.monotonic()
    if rank == 0:
        with pytest.raises(DivergenceError) as info:
            _step(model, rt, x)
        messages["timeout"] = (str(info.value), time.monotonic() - t0)
    else:
        time.sleep(2 * TIMEOUT_S + 3)  # stay alive (not in any collective) until rank 0 has given up
    return messages


def test_divergence_is_an_error_naming_module_and_ranks():
    results = run_distributed(_divergence_scenarios, 2, timeout_s=120)
    for rank, messages in enumerate(results):
        text, seconds = messages["first_step"]
        assert "'first'" in text and "'second'" in text and "ranks [0]" in text and "ranks [1]" in text, text
        assert seconds < 2 * TIMEOUT_S
        text, _ = messages["trailer"]
        assert "'first'" in text and "'second'" in text and "ranks [0]" in text and "ranks [1]" in text, text
    text, seconds = results[0]["timeout"]
    assert "rank 0 waited" in text and "'first'" in text and "ranks [1] never reached a parameter gather" in text, text
    assert seconds < 3 * TIMEOUT_S + 2
