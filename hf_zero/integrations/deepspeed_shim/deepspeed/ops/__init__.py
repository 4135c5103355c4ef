"""``deepspeed.ops``: the optimizers accelerate swaps in for CPU offload.

Only ``adam`` exists: hf_zero has no CPU Adagrad or Lion, so ``deepspeed.ops.adagrad`` and ``deepspeed.ops.lion``
are absent and accelerate's offload path raises ImportError for an Adagrad/Lion torch optimizer (instead of
silently training with a different optimizer).
"""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["adam"])
