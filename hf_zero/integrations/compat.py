"""Module-level names DeepSpeed exposes that hf_zero keeps under the same meaning for DeepSpeed-style code.

``deepspeed.utils.logger`` and ``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME`` forward here.
"""

from __future__ import annotations

import logging

from hf_zero.launcher.envfile import DEEPSPEED_ENVIRONMENT_NAME

__all__ = ["logger", "DEEPSPEED_ENVIRONMENT_NAME"]

# hf_zero's one logger. transformers sets its level from TrainingArguments.log_level through
# ``deepspeed.utils.logger.setLevel``, which is what it does to DeepSpeed's logger.
logger = logging.getLogger("hf_zero")
