"""``deepspeed.pipe`` is ``hf_zero.pipeline`` (PipelineModule, LayerSpec, TiedLayerSpec, the topologies)."""

from hf_zero.integrations.deepspeed_shim._forward import alias as _alias

_alias(__name__, "hf_zero.pipeline")
