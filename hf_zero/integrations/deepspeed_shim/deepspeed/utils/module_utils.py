"""``deepspeed.utils.module_utils``: ``recursive_getattr``, ``recursive_setattr`` (hf_zero.integrations.ds_utils)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.integrations.ds_utils:{name}" for name in ("recursive_getattr", "recursive_setattr")})
