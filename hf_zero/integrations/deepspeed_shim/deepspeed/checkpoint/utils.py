"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save`` -> ``hf_zero.checkpoint.clone``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"clone_tensors_for_torch_save": "hf_zero.checkpoint.clone:clone_tensors_for_torch_save"})
