"""The multi-process test helper itself: results from every rank, failures named by rank, hangs turned into errors."""

import pytest
import torch
import torch.distributed as dist

from hf_zero.testing import DistributedFailure, run_distributed


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return (dist.get_rank(), dist.get_world_size(), t.item())


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return dist.get_rank()


def _deadlock():
    t = torch.zeros(1)
    dist.recv(t, src=1 - dist.get_rank())  # both ranks wait for the other: a classic collective-order deadlock
    return dist.get_rank()


def test_runs_on_2_and_4_ranks():
    assert run_distributed(_sum_of_ranks, 2) == [(0, 2, 1.0), (1, 2, 1.0)]
    assert run_distributed(_sum_of_ranks, 4) == [(r, 4, 6.0) for r in range(4)]


def test_failure_on_rank_1_is_reported_with_its_traceback():
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_fail_on_rank_1, 2)
    assert sorted(info.value.per_rank) == [1]
    assert "ValueError: boom on rank one" in info.value.per_rank[1]
    assert "ranks [1]" in str(info.value)


def test_hang_becomes_a_failure_within_the_timeout():
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_deadlock, 2, timeout_s=6)  # the ranks block at once: a longer wait checks nothing more
    assert sorted(info.value.per_rank) == [0, 1]
    assert all("did not finish within 6s" in tb for tb in info.value.per_rank.values())


def _env_and_modules(name):
    import os
    import sys

    return (os.environ.get(name), os.getcwd(), "transformers.models.llama.modeling_llama" in sys.modules,
            _sum_of_ranks())


def test_fork_server_ranks_see_the_callers_environment(monkeypatch, tmp_path):
    # forked from a server started once with torch and transformers imported; environment and working directory are
    # the caller's at the time of the call, not the server's
    monkeypatch.setenv("HF_ZERO_TEST_MARK", "one")
    monkeypatch.chdir(tmp_path)
    first = run_distributed(_env_and_modules, 2, args=("HF_ZERO_TEST_MARK",), fork_server=True)
    monkeypatch.setenv("HF_ZERO_TEST_MARK", "two")
    second = run_distributed(_env_and_modules, 2, args=("HF_ZERO_TEST_MARK",), fork_server=True,
                             env={"HF_ZERO_OTHER": "x"})
    assert first == [("one", str(tmp_path), True, (r, 2, 1.0)) for r in range(2)]
    assert second == [("two", str(tmp_path), True, (r, 2, 1.0)) for r in range(2)]
