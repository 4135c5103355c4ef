"""``deepspeed.compression``: DeepSpeed 0.19 removed its compression library and kept ``compression.helper`` for the
two module helpers scripts import from it (DeepSpeed-Chat's LoRA module). hf_zero's compression methods are
``hf_zero.compression`` (``init_compression``, ``redundancy_clean``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {}, submodules=["helper"])
