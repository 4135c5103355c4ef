"""A stopped or dead rank in a pipeline run and in a tensor-parallel run ends every rank, non-zero, within the
documented bound (docs/reliability.md: ``comms_timeout_s + 2 * grace``), with an error naming the rank and what
happened to it -- the same failure path as ZeRO's collectives (tests/test_faults_comms.py): the pipeline's
receives are bounded by its groups' timeout and diagnosed by the fault channel (pipeline/failure.py), the TP
loss's all-reduces go through hf_zero's bounded, checked collectives (tensor_parallel/loss.py).

Rank 1 injects the fault at step 2 of 4 (tests/_parallel_faults_worker.py); a SIGSTOPped rank is continued once
rank 0 has ended, and its own time to exit is counted from then.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import _faults
from test_faults_comms import BOUND_S, SLACK_S, TIMEOUT_S, _assert_ended

WORKER = Path(__file__).with_name("_parallel_faults_worker.py")


def _launch(case: str, monkeypatch):
    monkeypatch.setattr(_faults, "WORKER", WORKER)
    return _faults.launch(case, 0, TIMEOUT_S, limit_s=120.0)


@pytest.mark.parametrize("kind", ["pipe", "tp"])
def test_a_stopped_rank_is_named_and_every_rank_exits(kind, monkeypatch):
    run = _launch(f"{kind}_sigstop", monkeypatch)
    times = _assert_ended(run, f"{kind} sigstop")
    survivor, stopped = run.ranks
    assert survivor.returncode == 1 and stopped.returncode == 1, (survivor.output, stopped.output)
    assert "rank 1 is stopped" in survivor.output and "SIGSTOP" in survivor.output, survivor.output
    # where rank 0 was: inside a pipeline step (a receive torch issued), or in the TP loss's bounded all-reduce
    where = "in train_batch" if kind == "pipe" else "the vocabulary-parallel loss's"
    assert where in survivor.output, survivor.output
    assert "DONE" not in survivor.output + stopped.output
    assert TIMEOUT_S <= times[0] < BOUND_S + SLACK_S, times
    assert run.continued_at is not None and times[1] < BOUND_S + SLACK_S, times


@pytest.mark.parametrize("kind", ["pipe", "tp"])
def test_a_killed_rank_is_named_by_the_survivor(kind, monkeypatch):
    run = _launch(f"{kind}_kill", monkeypatch)
    times = _assert_ended(run, f"{kind} kill")
    survivor, killed = run.ranks
    assert killed.returncode == -9
    assert survivor.returncode == 1 and "rank 1 died" in survivor.output, survivor.output
    assert "DONE" not in survivor.output
    assert times[0] < BOUND_S + SLACK_S, times
