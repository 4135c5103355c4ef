"""What this node runs, decided from the launcher flags: the same rules as DeepSpeed's runner.

- Resources: the hostfile's hosts and slots, or this machine alone (its GPUs, or one slot on a CPU-only machine)
  when there is no hostfile; then ``--include``/``--exclude``, or ``--num_nodes`` (first N hosts) and
  ``--num_gpus`` (first N slots of each) -- never both kinds, as DeepSpeed refuses.
- Without a hostfile, ``--num_nodes N --num_gpus P`` describes N identical nodes.
- One node runs locally. Several nodes: DeepSpeed would ssh into each; hf_zero instead runs on the node it is
  started on, as node ``--node_rank`` (or the hostfile entry matching this machine's hostname), and every node
  meets at ``--master_addr:--master_port`` (torch.distributed's static rendezvous, hosted by node 0).
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

from hf_zero.launcher.hosts import LaunchError, filter_resources, parse_core_list, read_hostfile

__all__ = ["NodePlan", "make_plan", "refuse_unsupported", "bind_cores"]


@dataclass(frozen=True)
class NodePlan:
    """One node's share of a launch."""

    nnodes: int
    node_rank: int
    nproc: int  # ranks on this node
    master_addr: str
    master_port: int
    slots: tuple[int, ...]  # this node's device indices (CUDA_VISIBLE_DEVICES on a GPU node)
    cores_per_rank: tuple[tuple[int, ...], ...] | None  # --bind_cores_to_rank: local rank -> its CPU cores


def refuse_unsupported(args: argparse.Namespace) -> None:
    """Flags of DeepSpeed machinery hf_zero does not have: an error naming the flag, never a silent no-op."""
    refused = {
        "--autotuning": bool(args.autotuning),
        "--elastic_training": args.elastic_training,
        "--min_elastic_nodes": args.min_elastic_nodes != -1,
        "--max_elastic_nodes": args.max_elastic_nodes != -1,
        "--save_pid": args.save_pid,
        "--force_multi": args.force_multi,
        "--launcher_args": bool(args.launcher_args),
        "--ssh_port": args.ssh_port is not None,
        "--venv_script": args.venv_script is not None,
    }
    named = [flag for flag, given in refused.items() if given]
    if named:
        raise LaunchError(f"{', '.join(named)}: not supported by hf_zero's launcher (it runs this node's ranks "
                          "through torch.distributed.run and starts nothing on other machines); remove the flag")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python are mutually exclusive")


def _own_host_index(hosts: list[str]) -> int | None:
    names = {socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
    matches = [i for i, h in enumerate(hosts) if h in names]
    if len(hosts) > 1 and len(set(hosts)) == len(hosts) and len(matches) == 1:
        return matches[0]
    return None


def bind_cores(nproc: int, core_list: str | None) -> tuple[tuple[int, ...], ...]:
    """Split the node's cores (``--bind_core_list`` or this process's affinity) into equal runs, one per rank."""
    cores = parse_core_list(core_list) if core_list else sorted(os.sched_getaffinity(0))
    per_rank = len(cores) // nproc
    if per_rank == 0:
        raise LaunchError(f"--bind_cores_to_rank: {len(cores)} core(s) {cores} cannot give each of {nproc} ranks "
                          "its own core; run fewer processes per node or give a longer --bind_core_list")
    return tuple(tuple(cores[r * per_rank:(r + 1) * per_rank]) for r in range(nproc))


def make_plan(args: argparse.Namespace, device_count: int) -> NodePlan:
    """``device_count``: GPUs this node sees (0 on a CPU-only node)."""
    refuse_unsupported(args)
    if (args.include or args.exclude) and (args.num_nodes >= 0 or args.num_gpus >= 0):
        raise LaunchError("--include/--exclude cannot be combined with --num_nodes/--num_gpus; use one or the other")
    if args.num_nodes == 0 or args.num_gpus == 0:
        raise LaunchError(f"--num_nodes {args.num_nodes} --num_gpus {args.num_gpus}: both must be >= 1 when given")

    hostfile = read_hostfile(args.hostfile)
    if hostfile is None:
        if args.num_nodes > 1:
            return _plan_without_hostfile(args, device_count)
        if args.num_gpus > 0 and device_count > 0 and args.num_gpus > device_count:
            raise LaunchError(f"--num_gpus {args.num_gpus}: this node has only {device_count} GPU(s)")
        # a CPU-only node has one slot by default; --num_gpus N runs N processes on it (one per rank)
        slots = args.num_gpus if args.num_gpus > 0 else max(device_count, 1)
        resources = {"localhost": list(range(slots))}
    else:
        resources = {h: list(range(n)) for h, n in hostfile.items()}
    resources = filter_resources(resources, args.include, args.exclude)
    if args.num_nodes > 0:
        if args.num_nodes > len(resources):
            raise LaunchError(f"--num_nodes {args.num_nodes}: the hostfile {args.hostfile} has only "
                              f"{len(resources)} host(s)")
        resources = dict(list(resources.items())[:args.num_nodes])
    if args.num_gpus > 0:
        short = {h: len(s) for h, s in resources.items() if len(s) < args.num_gpus}
        if short:
            raise LaunchError(f"--num_gpus {args.num_gpus}: host(s) {short} have fewer slots in {args.hostfile}")
        resources = {h: s[:args.num_gpus] for h, s in resources.items()}

    hosts = list(resources)
    if len(hosts) == 1:
        if args.node_rank > 0:
            raise LaunchError(f"--node_rank {args.node_rank} but the run has a single node ({hosts[0]})")
        node_rank, master_addr = 0, args.master_addr or "127.0.0.1"
    else:
        node_rank = args.node_rank if args.node_rank >= 0 else _own_host_index(hosts)
        if node_rank is None:
            raise LaunchError(f"a {len(hosts)}-node run ({', '.join(hosts)}): hf_zero does not ssh into the other "
                              "nodes; run this same command on each node with --node_rank <its index in the "
                              "hostfile> (node 0 hosts the rendezvous at --master_addr:--master_port)")
        if not 0 <= node_rank < len(hosts):
            raise LaunchError(f"--node_rank {node_rank}: the run has nodes 0..{len(hosts) - 1} ({', '.join(hosts)})")
        master_addr = args.master_addr or hosts[0]
    slots = tuple(resources[hosts[node_rank]])
    return NodePlan(nnodes=len(hosts), node_rank=node_rank, nproc=len(slots), master_addr=master_addr,
                    master_port=args.master_port, slots=slots,
                    cores_per_rank=bind_cores(len(slots), args.bind_core_list) if args.bind_cores_to_rank else None)


def _plan_without_hostfile(args: argparse.Namespace, device_count: int) -> NodePlan:
    """``--num_nodes N`` with no hostfile: N nodes like this one, each started with its own ``--node_rank``."""
    if args.include or args.exclude:
        raise LaunchError("--include/--exclude need a hostfile naming the hosts (--hostfile)")
    if args.node_rank < 0 or not args.master_addr:
        raise LaunchError(f"--num_nodes {args.num_nodes} without a hostfile ({args.hostfile} does not exist): "
                          "run this command on every node with --node_rank <0..N-1> and --master_addr <node 0's "
                          "address>, or give --hostfile")
    if args.node_rank >= args.num_nodes:
        raise LaunchError(f"--node_rank {args.node_rank}: --num_nodes {args.num_nodes} means ranks 0..{args.num_nodes - 1}")
    nproc = args.num_gpus if args.num_gpus > 0 else max(device_count, 1)
    return NodePlan(nnodes=args.num_nodes, node_rank=args.node_rank, nproc=nproc, master_addr=args.master_addr,
                    master_port=args.master_port, slots=tuple(range(nproc)),
                    cores_per_rank=bind_cores(nproc, args.bind_core_list) if args.bind_cores_to_rank else None)
