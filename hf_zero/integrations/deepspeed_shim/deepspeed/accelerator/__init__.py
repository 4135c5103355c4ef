"""``deepspeed.accelerator.get_accelerator()``: the device this process computes on (``hf_zero.comm.accelerator``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"get_accelerator": "hf_zero.comm.accelerator:get_accelerator"})
