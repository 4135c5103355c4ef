"""``deepspeed.sequence``: DeepSpeed-Ulysses' ``layer.DistributedAttention`` (``hf_zero.sequence_parallel``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["layer"])
