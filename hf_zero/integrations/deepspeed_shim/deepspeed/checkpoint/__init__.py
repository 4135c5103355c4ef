"""``deepspeed.checkpoint``: only ``utils.clone_tensors_for_torch_save``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["utils"])
