"""``deepspeed.runtime.pipe.engine.PipelineEngine`` is ``hf_zero.runtime.pipe_engine.PipelineEngine``."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"PipelineEngine": "hf_zero.runtime.pipe_engine:PipelineEngine"})
