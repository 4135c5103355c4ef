"""``deepspeed.sequence.layer``: DistributedAttention (``hf_zero.sequence_parallel.distributed_attention``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.sequence_parallel.distributed_attention:{name}" for name in (
    "DistributedAttention", "apply_rotary_pos_emb")})
