"""``deepspeed.utils.torch``: ``required_torch_version`` (``hf_zero.integrations.ds_utils``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"required_torch_version": "hf_zero.integrations.ds_utils:required_torch_version"})
