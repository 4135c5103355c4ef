"""``deepspeed.runtime.pipe.topology`` is ``hf_zero.pipeline.topology`` (ProcessTopology, PipeDataParallelTopology,
PipeModelDataParallelTopology, PipelineParallelGrid)."""

from hf_zero.integrations.deepspeed_shim._forward import alias as _alias

_alias(__name__, "hf_zero.pipeline.topology")
