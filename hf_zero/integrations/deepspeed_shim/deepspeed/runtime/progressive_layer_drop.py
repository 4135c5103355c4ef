"""``deepspeed.runtime.progressive_layer_drop``: ProgressiveLayerDrop (``hf_zero.runtime.pld``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"ProgressiveLayerDrop": "hf_zero.runtime.pld:ProgressiveLayerDrop"})
