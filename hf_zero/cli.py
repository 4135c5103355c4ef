"""The ``hf-zero`` command line (console script declared in pyproject.toml; also ``python -m hf_zero``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "ds_report"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-zero", description="hf_zero: ZeRO training for the Hugging Face stack")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("doctor", help="report versions, compiled ops, distributed backends and the deepspeed layer")
    commands.add_parser("launch", add_help=False,
                        help="run a training script on every rank (DeepSpeed's launcher flags; see 'launch -h')")
    from hf_zero.profiling.estimate_cli import add_parser as add_estimate

    add_estimate(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        # the launcher has its own parser: everything after the script name belongs to the script
        from hf_zero.launcher import main as launch_main

        return launch_main(argv[1:], prog="hf-zero launch")
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from hf_zero.doctor import main as doctor_main

        return doctor_main()
    if args.command == "estimate":
        from hf_zero.profiling.estimate_cli import run

        return run(args)
    parser.print_help()
    return 2


def ds_report() -> int:
    """The ``ds_report`` command (what DeepSpeed's issue template asks users to paste): a real DeepSpeed's report
    when one is installed (the rule of the ``deepspeed`` command, hf_zero/integrations/deepspeed_command.py), else
    ``hf-zero doctor``."""
    from hf_zero.integrations.deepspeed_command import real_deepspeed_installed

    if real_deepspeed_installed():
        from deepspeed.env_report import cli_main  # the real one: the shim stands aside

        return cli_main() or 0
    from hf_zero.doctor import main as doctor_main

    return doctor_main()

