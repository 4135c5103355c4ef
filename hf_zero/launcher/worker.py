"""The first thing each rank runs (``python -m hf_zero.launcher.worker python local_rank script args...``).

torch.distributed.run has already set RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and
MASTER_PORT. This adds what DeepSpeed's per-node launcher gives its ranks -- LOCAL_SIZE, CROSS_RANK, CROSS_SIZE,
``--local_rank=N`` right after the script name, and, with ``--bind_cores_to_rank``, the rank's own CPU cores
and OMP_NUM_THREADS -- then *execs* the script, so the rank keeps this process id (the agent watches it) and
the script runs exactly as under ``python script.py``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["BIND_CORES_ENV", "main"]

# local rank r's cores: the r-th ';'-separated field, a ','-separated core list (set by run.py for every rank)
BIND_CORES_ENV = "HF_ZERO_LAUNCH_BIND_CORES"


def _command(argv: list[str], local_rank: int) -> list[str]:
    """``argv`` = ``[python|module|exec, local_rank|no_local_rank, script, *args]`` (fixed leading fields: the
    elastic agent's argument parsing would swallow a ``--`` separator)."""
    if len(argv) < 3 or argv[0] not in ("python", "module", "exec") or argv[1] not in ("local_rank",
                                                                                         "no_local_rank"):
        raise SystemExit(f"hf_zero.launcher.worker: expected 'python|module|exec local_rank|no_local_rank "
                         f"script [args...]', got {argv}")
    how, rank_flag, script, *user_args = argv
    rank_arg = [f"--local_rank={local_rank}"] if rank_flag == "local_rank" else []
    if how == "exec":
        return [script, *rank_arg, *user_args]
    if how == "module":
        return [sys.executable, "-u", "-m", script, *rank_arg, *user_args]
    return [sys.executable, "-u", script, *rank_arg, *user_args]


def _bind(local_rank: int) -> None:
    spec = os.environ.pop(BIND_CORES_ENV, None)
    if not spec:
        return
    cores = [int(c) for c in spec.split(";")[local_rank].split(",")]
    os.sched_setaffinity(0, cores)  # inherited across exec: the script and its threads stay on these cores
    os.environ["OMP_NUM_THREADS"] = str(len(cores))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    local_rank = int(os.environ["LOCAL_RANK"])
    os.environ["LOCAL_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE", "1")
    os.environ["CROSS_RANK"] = os.environ.get("GROUP_RANK", "0")
    os.environ["CROSS_SIZE"] = os.environ.get("GROUP_WORLD_SIZE", "1")
    _bind(local_rank)
    command = _command(argv, local_rank)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        raise SystemExit(f"hf_zero launcher: cannot run {command[0]!r} on local rank {local_rank}: {exc}") from None


if __name__ == "__main__":
    main()
