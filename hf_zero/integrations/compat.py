"""Module-level names DeepSpeed exposes that hf_zero keeps under the same meaning for DeepSpeed-style code.

``deepspeed.utils.logger`` and ``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME`` forward here.
"""

from __future__ import annotations

import logging
import os

__all__ = ["logger", "DEEPSPEED_ENVIRONMENT_NAME"]

# hf_zero's one logger. transformers sets its level from TrainingArguments.log_level through
# ``deepspeed.utils.logger.setLevel``, which is what it does to DeepSpeed's logger.
logger = logging.getLogger("hf_zero")

# The file of extra environment variables that DeepSpeed's multi-node launcher forwards to every node
# (``DS_ENV_FILE``, default ``.deepspeed_env``); accelerate launch appends to it for multi-node DEEPSPEED runs.
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
