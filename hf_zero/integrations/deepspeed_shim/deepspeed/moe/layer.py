"""``deepspeed.moe.layer``: MoE -> ``hf_zero.moe.MoE`` (data-parallel experts)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"MoE": "hf_zero.moe.layer:MoE"})
