"""``deepspeed.runtime.fp16``: only ``loss_scaler`` (DeepSpeed's FP16 optimizers are hf_zero's engine)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["loss_scaler"])
