"""Which sequence-parallel size the engine trains with: from the mpu (accelerate's path passes the one
``register_with_transformers`` returned) or from the config's top-level ``sequence_parallel_size``.

The engine needs the size for one thing: the batch arithmetic counts data-parallel replicas, and the ranks of one
SP group are one replica (``train_batch_size = micro * accumulation * world / sp_size``, as DeepSpeed). Gradients
are reduced and ZeRO partitions over every rank either way (comm/sequence_groups.py says why).
"""

from __future__ import annotations

from hf_zero.comm import sequence_groups
from hf_zero.config.errors import ConfigError

__all__ = ["sequence_parallel_size"]

KEY = "sequence_parallel_size"


def sequence_parallel_size(config_value, mpu_size: int, *, model_parallel: str | None = None) -> int:
    """Check the config's ``sequence_parallel_size`` against the mpu's; set up the groups when only the config asks.

    ``model_parallel``: what else splits the model (``"tensor parallelism"``, ``"a pipeline"``), refused with SP.
    """
    if config_value is not None and (isinstance(config_value, bool) or not isinstance(config_value, int)
                                     or config_value < 1):
        raise ConfigError(KEY, f"{config_value!r}: must be a positive integer")
    if mpu_size > 1 and config_value is not None and config_value != mpu_size:
        raise ConfigError(KEY, f"{config_value}, but the mpu passed to initialize() has a sequence-parallel size of "
                               f"{mpu_size} (mpu.get_sequence_parallel_world_size()); make them equal or drop the key")
    size = mpu_size if mpu_size > 1 else (config_value or 1)
    if size > 1 and model_parallel is not None:
        raise ConfigError(KEY, f"{size} together with {model_parallel}: hf_zero runs Ulysses sequence parallelism "
                               "over data parallelism only")
    if size > 1 and mpu_size == 1:
        try:
            sequence_groups.initialize_sequence_parallel(size)
        except ValueError as e:
            raise ConfigError(KEY, f"{size}: {e}") from None
    return size
