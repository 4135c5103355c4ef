"""``deepspeed.ops.adam.fused_adam``: where DeepSpeed defines FusedAdam (scripts import it from here) ->
``hf_zero.ops.adam.FusedAdam``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"FusedAdam": "hf_zero.ops.adam:FusedAdam"})
