"""``deepspeed.runtime.data_pipeline.data_routing.basic_layer`` (hf_zero/runtime/random_ltd.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"RandomLayerTokenDrop": "hf_zero.runtime.random_ltd:RandomLayerTokenDrop"})
