"""``deepspeed.runtime.pipe``: the pipeline module, its layer specs and topologies (``hf_zero.pipeline``) and the
pipeline engine (``hf_zero.runtime.pipe_engine``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    **{name: f"hf_zero.pipeline:{name}" for name in (
        "PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
        "PipeModelDataParallelTopology")},
}, submodules=["engine", "module", "topology"])
