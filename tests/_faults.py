"""Launch tests/_faults_worker.py on 2 local ranks and measure how each ends (exit status, output, seconds)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hf_zero.comm.process_group import free_port

WORKER = Path(__file__).with_name("_faults_worker.py")
REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class RankEnd:
    rank: int
    returncode: int | None
    output: str
    ended_at: float          # wall clock (time.time())


@dataclasses.dataclass
class Run:
    ranks: list[RankEnd]
    fault_at: float | None   # wall clock of the injection (printed by the faulty rank)
    continued_at: float | None = None  # when the SIGSTOPped rank was sent SIGCONT

    def seconds_to_exit(self, rank: int) -> float:
        start = self.continued_at if (self.continued_at and rank == 1) else self.fault_at
        return self.ranks[rank].ended_at - start


def launch(case: str, stage: int, timeout_s: float, *, limit_s: float = 60.0, env: dict | None = None,
           preexec: dict | None = None) -> Run:
    """Run both ranks; a SIGSTOPped rank is continued once every other rank has ended. Every process is killed
    at ``limit_s`` (a hang fails the test instead of CI)."""
    port = free_port()
    procs = []
    for rank in range(2):
        e = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                 PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {}))
        e.pop("DEEPSPEED_TIMEOUT", None)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), case, str(stage), str(timeout_s)], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      preexec_fn=(preexec or {}).get(rank)))
    deadline = time.monotonic() + limit_s
    ended: dict[int, float] = {}
    continued_at = None
    try:
        while len(ended) < 2 and time.monotonic() < deadline:
            for rank, p in enumerate(procs):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = time.time()
            if continued_at is None and len(ended) == 1 and _stopped(procs[1].pid) and 0 in ended:
                continued_at = time.time()
                os.kill(procs[1].pid, signal.SIGCONT)
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [p.communicate()[0] for p in procs]
    fault_at = None
    for text in outs:
        for line in text.splitlines():
            if line.startswith("FAULT_AT "):
                fault_at = float(line.split()[1])
    return Run([RankEnd(r, procs[r].returncode if r in ended else None, outs[r], ended.get(r, float("nan")))
                for r in range(2)], fault_at, continued_at)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False
