"""``deepspeed.runtime.activation_checkpointing``: the ``checkpointing`` module, imported on first use."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["checkpointing"])
