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
        run_distributed(_deadlock, 2, timeout_s=15)
    assert sorted(info.value.per_rank) == [0, 1]
    assert all("did not finish within 15s" in tb for tb in info.value.per_rank.values())
