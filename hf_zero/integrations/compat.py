"""Module-level names DeepSpeed exposes that hf_zero keeps under the same meaning for DeepSpeed-style code.

``deepspeed.utils.logger``, ``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME`` and
``deepspeed.ops.__compatible_ops__`` forward here.
"""

from __future__ import annotations

import logging

from hf_zero.launcher.envfile import DEEPSPEED_ENVIRONMENT_NAME

__all__ = ["logger", "DEEPSPEED_ENVIRONMENT_NAME", "compatible_ops"]

# hf_zero's one logger. transformers sets its level from TrainingArguments.log_level through
# ``deepspeed.utils.logger.setLevel``, which is what it does to DeepSpeed's logger.
logger = logging.getLogger("hf_zero")

# DeepSpeed's op builder NAME -> whether the op runs here. Scripts and test suites gate on it
# (transformers' ``require_deepspeed_aio`` reads ``deepspeed.ops.__compatible_ops__["async_io"]`` at import).
# hf_zero builds its ops at install and each has a pure-PyTorch/POSIX reference, so every op it offers under a
# DeepSpeed name runs on any machine: async_io (pread/pwrite pool, no libaio), the CPU optimizers, FusedAdam.
# DeepSpeed's own CUDA-only kernels (transformer inference, sparse attention, ...) are absent, not False-valued:
# code that indexes them without a default fails as it would on a DeepSpeed without them built.
compatible_ops: dict[str, bool] = {
    "async_io": True,
    "cpu_adam": True,
    "cpu_adagrad": True,
    "cpu_lion": True,
    "fused_adam": True,
}
