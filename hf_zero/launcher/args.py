"""The launcher's command line: DeepSpeed's runner flags, same names, same defaults.

Flags that belong to DeepSpeed machinery hf_zero does not have (ssh/pdsh/MPI fan-out, autotuning, elastic
training) are still parsed, so that using one is answered by an error naming it (``plan.refuse_unsupported``)
rather than by argparse's generic "unrecognized arguments" or by being silently ignored.
"""

from __future__ import annotations

import argparse

__all__ = ["build_parser", "DEFAULT_HOSTFILE", "DEFAULT_MASTER_PORT"]

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default (DLTS_HOSTFILE); absent means "this machine only"
DEFAULT_MASTER_PORT = 29500  # torch.distributed's default port, as DeepSpeed's


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Launch a training script on every rank of this node (DeepSpeed's launcher flags, run by "
                    "torch.distributed.run). Multi-node: run the same command on every node with --node_rank.")
    add = parser.add_argument
    add("-H", "--hostfile", type=str, default=DEFAULT_HOSTFILE,
        help="file of 'hostname slots=N' lines; the nodes and processes per node of a multi-node run")
    add("-i", "--include", type=str, default="",
        help="use only these hosts/slots, e.g. 'worker-0@worker-1:0,2' (not with --num_nodes/--num_gpus)")
    add("-e", "--exclude", type=str, default="",
        help="leave out these hosts/slots, same syntax as --include (not with --num_nodes/--num_gpus)")
    add("--num_nodes", type=int, default=-1, help="number of nodes (the first N of the hostfile)")
    add("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
        help="processes per node (default: the GPUs this node has; 1 on a CPU-only node)")
    add("--master_port", type=int, default=DEFAULT_MASTER_PORT, help="rendezvous port on the master node")
    add("--master_addr", type=str, default="",
        help="rendezvous address: node 0's (default: 127.0.0.1 on one node, else the first host of the hostfile)")
    add("--node_rank", type=int, default=-1,
        help="this node's index among the nodes (multi-node: given on each node, or found from the hostname)")
    add("--launcher", type=str, default="pdsh",
        help="DeepSpeed's multi-node fan-out (pdsh/openmpi/...); hf_zero starts no remote processes, so a "
             "multi-node run is this command run on each node with --node_rank")
    add("--launcher_args", type=str, default="", help="(DeepSpeed's fan-out only; refused)")
    add("--module", action="store_true", help="run user_script as a Python module (python -m)")
    add("--no_python", action="store_true", help="run user_script directly, without the Python interpreter")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add("--no_ssh", action="store_true", help="each node runs this command itself (needs --node_rank)")
    add("--no_ssh_check", action="store_true", help="accepted: hf_zero never checks ssh")
    add("--force_multi", action="store_true", help="(DeepSpeed's fan-out on a single node; refused)")
    add("--save_pid", action="store_true", help="(refused)")
    add("--enable_each_rank_log", type=str, default="None",
        help="directory for one stdout/stderr log file per rank instead of the console")
    add("--autotuning", type=str, default="", choices=["", "tune", "run"], help="(DeepSpeed's autotuner; refused)")
    add("--elastic_training", action="store_true", help="(refused)")
    add("--min_elastic_nodes", type=int, default=-1, help="(refused)")
    add("--max_elastic_nodes", type=int, default=-1, help="(refused)")
    add("--bind_cores_to_rank", action="store_true",
        help="pin each rank to its own share of this node's CPU cores and set OMP_NUM_THREADS to its size")
    add("--bind_core_list", type=str, default=None,
        help="the cores --bind_cores_to_rank shares out, e.g. '0-3,8-11' (default: the cores this process may use)")
    add("--ssh_port", type=int, default=None, help="(DeepSpeed's fan-out only; refused)")
    add("--venv_script", type=str, default=None, help="(DeepSpeed's fan-out only; refused)")
    add("user_script", type=str, help="the training script (or module with --module) every rank runs")
    add("user_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser
