"""``deepspeed.inference.config``: ``DeepSpeedInferenceConfig`` -> hf_zero's parsed inference config."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "DeepSpeedInferenceConfig": "hf_zero.runtime.inference_config:DeepSpeedInferenceConfig",
    "DeepSpeedTPConfig": "hf_zero.runtime.inference_config:TPInferenceConfig",
})
