"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save`` -> ``hf_zero.runtime.checkpoint_utils``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"clone_tensors_for_torch_save": "hf_zero.runtime.checkpoint_utils:clone_tensors_for_torch_save"})
