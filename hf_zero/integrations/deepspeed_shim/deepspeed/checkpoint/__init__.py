"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save`` and the ``ds_to_universal`` command."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["ds_to_universal", "utils"])
