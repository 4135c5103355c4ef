"""``deepspeed.runtime.activation_checkpointing.checkpointing`` (also ``deepspeed.checkpointing``) is
:mod:`hf_zero.runtime.activation_checkpointing`: configure, checkpoint, non_reentrant_checkpoint, the RNG tracker."""

from hf_zero.integrations.deepspeed_shim._forward import alias as _alias

_alias(__name__, "hf_zero.runtime.activation_checkpointing")
