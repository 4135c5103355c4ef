"""Module-level names DeepSpeed exposes that hf_zero keeps under the same meaning for DeepSpeed-style code.

``deepspeed.utils.logger``, ``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME`` and
``deepspeed.ops.__compatible_ops__`` forward here, and ``deepspeed.initialize``: hf_zero's, announcing itself on
DeepSpeed's logger as DeepSpeed does.
"""

from __future__ import annotations

import functools
import logging

from hf_zero.integrations.ds_op_builder import UNAVAILABLE_OP_NAMES
from hf_zero.launcher.envfile import DEEPSPEED_ENVIRONMENT_NAME

__all__ = ["logger", "DEEPSPEED_ENVIRONMENT_NAME", "compatible_ops", "initialize"]

# hf_zero's one logger. transformers sets its level from TrainingArguments.log_level through
# ``deepspeed.utils.logger.setLevel``, which is what it does to DeepSpeed's logger.
logger = logging.getLogger("hf_zero")

# DeepSpeed's op builder NAME -> whether the op runs here. Scripts and test suites gate on it
# (transformers' ``require_deepspeed_aio`` reads ``deepspeed.ops.__compatible_ops__["async_io"]`` at import).
# hf_zero builds its ops at install and each has a pure-PyTorch/POSIX reference, so every op it offers under a
# DeepSpeed name runs on any machine: async_io (pread/pwrite pool, no libaio), the CPU optimizers, FusedAdam.
# DeepSpeed's other ops (its CUDA kernels for transformer inference, LAMB, quantizers, ...) are listed False, as
# DeepSpeed lists an op it cannot build on the machine: its own tests index them at import
# (``__compatible_ops__[FusedLambBuilder.NAME]``).
compatible_ops: dict[str, bool] = {
    "async_io": True,
    "cpu_adam": True,
    "cpu_adagrad": True,
    "cpu_lion": True,
    "fused_adam": True,
    **{op: False for op in UNAVAILABLE_OP_NAMES.values()},
}


def _initialize():
    from hf_zero.runtime.initialize import initialize as hf_zero_initialize

    @functools.wraps(hf_zero_initialize)
    def initialize(*args, **kwargs):
        result = hf_zero_initialize(*args, **kwargs)
        # DeepSpeed logs "DeepSpeed info: version=..." on rank 0 when an engine is built; tools and test suites
        # (transformers' DeepSpeed Trainer tests) read it off ``deepspeed.utils.logger`` as the sign that the
        # engine is in use. Say the same, and say which engine answered.
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            from hf_zero.integrations.deepspeed_shim import shim_version

            logger.info("DeepSpeed info: version=%s (hf_zero answering `import deepspeed`; DeepSpeed itself is not "
                        "installed)", shim_version())
        return result

    return initialize


initialize = _initialize()
