"""The ``hf-zero`` command line (console script declared in pyproject.toml; also ``python -m hf_zero``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-zero", description="hf_zero: ZeRO training for the Hugging Face stack")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("doctor", help="report versions, compiled ops, distributed backends and the deepspeed layer")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from hf_zero.doctor import main as doctor_main

        return doctor_main()
    parser.print_help()
    return 2
