"""``deepspeed.accelerator.get_accelerator()``: the device this process computes on (``hf_zero.comm.accelerator``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.comm.accelerator:{name}" for name in (
    "get_accelerator", "is_current_accelerator_supported", "SUPPORTED_ACCELERATOR_LIST")})
