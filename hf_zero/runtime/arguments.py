"""DeepSpeed's command-line arguments for training scripts: ``add_config_arguments`` and how ``initialize(args=)``
reads them back.

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)   # the launcher passes --local_rank=N
    parser = hf_zero.add_config_arguments(parser)                # --deepspeed, --deepspeed_config, ...
    args = parser.parse_args()
    engine, *_ = hf_zero.initialize(args=args, model=model, model_parameters=model.parameters())
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from hf_zero.config.errors import ConfigError

__all__ = ["add_config_arguments", "config_from_args", "align_local_rank"]

logger = logging.getLogger("hf_zero")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group to ``parser`` (same flags, defaults and meaning) and return it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (hf_zero)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script's own use; initialize() does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON config file, read by initialize(args=...)")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated spelling of --deepspeed_config")
    return parser


def config_from_args(args: Any) -> Any:
    """The config named on the command line (``args.deepspeed_config``, or the deprecated
    ``args.deepscale_config``, which is moved onto ``deepspeed_config`` as DeepSpeed does), or None."""
    if args is None:
        return None
    deprecated = getattr(args, "deepscale_config", None)
    if deprecated is not None:
        logger.warning("hf_zero: --deepscale_config is deprecated, use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is not None:
            raise ConfigError("deepspeed_config", f"both --deepscale_config ({deprecated}) and --deepspeed_config "
                                                  f"({args.deepspeed_config}) were given; pass only --deepspeed_config")
        args.deepspeed_config = deprecated
        args.deepscale_config = None
    return getattr(args, "deepspeed_config", None) or getattr(args, "hf_zero_config", None)


def align_local_rank(args: Any) -> None:
    """``args.local_rank`` becomes this process's LOCAL_RANK, as DeepSpeed sets it (scripts index devices by it)."""
    if args is not None and hasattr(args, "local_rank") and "LOCAL_RANK" in os.environ:
        args.local_rank = int(os.environ["LOCAL_RANK"])
