"""Hand a :class:`NodePlan` to ``torch.distributed.run``: it starts this node's ranks, joins the rendezvous,
watches them, and stops them all when one fails."""

from __future__ import annotations

import argparse
import os
import sys

from hf_zero.launcher.envfile import read_environment_files
from hf_zero.launcher.hosts import LaunchError
from hf_zero.launcher.plan import NodePlan, make_plan
from hf_zero.launcher.worker import BIND_CORES_ENV

__all__ = ["launch", "torchrun_args"]


def torchrun_args(plan: NodePlan, args: argparse.Namespace) -> list[str]:
    """The ``torch.distributed.run`` command line for this node (static rendezvous at master_addr:master_port)."""
    argv = ["--nnodes", str(plan.nnodes), "--node-rank", str(plan.node_rank), "--nproc-per-node", str(plan.nproc),
            "--master-addr", plan.master_addr, "--master-port", str(plan.master_port), "--max-restarts", "0"]
    if args.enable_each_rank_log != "None":
        os.makedirs(args.enable_each_rank_log, exist_ok=True)
        argv += ["--log-dir", args.enable_each_rank_log, "--redirects", "3"]
    how = "module" if args.module else "exec" if args.no_python else "python"
    rank_flag = "no_local_rank" if args.no_local_rank else "local_rank"
    return [*argv, "--module", "hf_zero.launcher.worker", how, rank_flag, args.user_script, *args.user_args]


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(args: argparse.Namespace, *, raise_errors: bool = False) -> int:
    """``raise_errors``: a launch that cannot go ahead raises LaunchError (a ValueError, as DeepSpeed's
    ``runner.main`` raises for a script calling it) instead of printing it and returning 2 (the command line)."""
    try:
        plan = make_plan(args, _device_count())
        exports = read_environment_files() if plan.nnodes > 1 else {}
    except LaunchError as exc:
        if raise_errors:
            raise
        print(f"hf_zero launcher: error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(exports)
    if _device_count() > 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in plan.slots)
    if plan.cores_per_rank is not None:
        os.environ[BIND_CORES_ENV] = ";".join(",".join(map(str, cores)) for cores in plan.cores_per_rank)
    if plan.nproc > 1 and "OMP_NUM_THREADS" not in os.environ and plan.cores_per_rank is None:
        # as torch.distributed.run does (and says so): one thread per rank unless the user chose otherwise
        os.environ["OMP_NUM_THREADS"] = "1"

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:
        run(get_args_parser().parse_args(torchrun_args(plan, args)))
    except ChildFailedError as exc:
        return _root_exit_code(exc.failures)
    return 0


def _root_exit_code(failures: dict) -> int:
    """The launcher's exit status: the code of the rank that failed first, as DeepSpeed's launcher returns it. When
    one rank fails, the agent stops the others with SIGTERM (then SIGKILL); those ranks appear among the failures
    too, and one still alive then would otherwise hide the real code behind -15 (exit status 241)."""
    import signal

    stopped_by_agent = (-signal.SIGTERM, -signal.SIGKILL)
    ranked = sorted(failures.items(), key=lambda item: (item[1].exitcode in stopped_by_agent, item[1].timestamp,
                                                        item[0]))
    code = next((f.exitcode for _, f in ranked if f.exitcode not in (0, None)), 1)
    return code if code > 0 else 128 - code  # a signal: the shell's 128 + signal number

