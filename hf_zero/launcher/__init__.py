"""``hf-zero launch`` / ``deepspeed``: DeepSpeed's launcher command line, built on ``torch.distributed.run``.

    hf-zero launch --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json
    hf-zero launch --hostfile hosts --node_rank 1 --master_addr node0 train.py ...   # on each node

- ``args.py``: DeepSpeed's flags (``--num_gpus``, ``--num_nodes``, ``--hostfile``, ``--include``, ...).
- ``hosts.py``: hostfiles and ``--include``/``--exclude`` filters (DeepSpeed's ``host:slot,slot@host`` syntax).
- ``plan.py``: what this node runs: how many nodes, this node's rank, processes here, rendezvous, core binding.
- ``envfile.py``: ``.deepspeed_env``, the variables a multi-node launch exports to every rank.
- ``run.py``: hands the plan to ``torch.distributed.run`` (the elastic agent starts, watches and stops the ranks).
- ``worker.py``: the first thing each rank runs: binds cores, sets DeepSpeed's extra variables, then execs the
  training script with ``--local_rank=N`` as DeepSpeed's launcher passes it.

Nothing here imports torch at module level: the worker runs once per rank before the training script.

Owns the launch command line only. Bottom layer: imports no other hf_zero package (the layer table is ``LAYERS`` in
``tests/test_layering.py``).
"""

from __future__ import annotations

__all__ = ["main", "parse_args", "runner_main"]


def parse_args(args=None, prog: str = "hf-zero launch"):
    """DeepSpeed's ``runner.parse_args``: the launcher flags plus ``user_script`` and ``user_args``."""
    from hf_zero.launcher.args import build_parser

    return build_parser(prog).parse_args(args)


def main(args=None, prog: str = "hf-zero launch") -> int:
    """Run a training script on this node's ranks; returns the exit code (the first failing rank's, else 0)."""
    from hf_zero.launcher.run import launch

    return launch(parse_args(args, prog))


def runner_main(args=None) -> int:
    """``deepspeed.launcher.runner.main`` called from Python: as :func:`main`, but flags that cannot go together
    raise LaunchError (a ValueError), as DeepSpeed's does, instead of being printed."""
    from hf_zero.launcher.run import launch

    return launch(parse_args(args, "deepspeed"), raise_errors=True)
