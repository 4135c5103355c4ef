"""``deepspeed.runtime.zero.config``: ``ZeroStageEnum`` (DeepSpeed's checkpoints pickle it; scripts compare stages
with it)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "ZeroStageEnum": "hf_zero.checkpoint.deepspeed_format:ZeroStageEnum",
})
