"""``deepspeed.inference.engine``: ``InferenceEngine`` (``hf_zero.runtime.inference``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"InferenceEngine": "hf_zero.runtime.inference:InferenceEngine"})
