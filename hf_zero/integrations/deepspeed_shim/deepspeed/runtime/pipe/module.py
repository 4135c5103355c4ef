"""``deepspeed.runtime.pipe.module``: PipelineModule, LayerSpec, TiedLayerSpec (``hf_zero.pipeline.module``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.pipeline.module:{name}" for name in (
    "PipelineModule", "LayerSpec", "TiedLayerSpec")})
