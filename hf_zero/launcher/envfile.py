"""DeepSpeed's ``.deepspeed_env``: extra ``KEY=VALUE`` variables a multi-node launch exports to every rank.

accelerate launch appends to this file for multi-node DEEPSPEED runs (it imports the name from
``deepspeed.launcher.runner``, which forwards here).
"""

from __future__ import annotations

import os

from hf_zero.launcher.hosts import LaunchError

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "read_environment_files"]

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")


def read_environment_files() -> dict[str, str]:
    """The variables of ``.deepspeed_env`` in the home directory, then the working directory (later wins)."""
    exports: dict[str, str] = {}
    for folder in (os.path.expanduser("~"), "."):
        path = os.path.join(folder, DEEPSPEED_ENVIRONMENT_NAME)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for number, raw in enumerate(f, start=1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                key, sep, value = line.partition("=")
                if not sep or not key.strip():
                    raise LaunchError(f"{path}, line {number}: {line!r} is not KEY=VALUE")
                exports[key.strip()] = value.strip()
    return exports
