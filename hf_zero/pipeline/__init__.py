"""hf_zero.pipeline: pipeline parallelism on ``torch.distributed.pipelining``.

- DeepSpeed's API (also ``hf_zero.pipe`` / ``deepspeed.pipe``): :class:`PipelineModule`, :class:`LayerSpec`,
  :class:`TiedLayerSpec`, the topologies; ``hf_zero.initialize(model=PipelineModule(...))`` returns a pipeline
  engine with ``train_batch``/``eval_batch``.
- Hugging Face decoders as they are: :func:`wrap` (Llama family, GPT-2), and :func:`from_pretrained`, which loads
  only each stage's own weights.

Names are imported on first use (``import hf_zero`` stays cheap).

Owns the split of a model into stages, the schedules and the pipeline's tied weights; its grid lays a topology out
on the run's mesh (hf_zero.parallel). May import zero, offload, profiling, parallel, comm, ops and config; never runtime, integrations, or its peers compression and tensor_parallel (the
layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from __future__ import annotations

from hf_zero.util import lazy_exports

_LAZY = {
    "PipelineModule": "hf_zero.pipeline.module", "LayerSpec": "hf_zero.pipeline.module",
    "TiedLayerSpec": "hf_zero.pipeline.module", "PipelineError": "hf_zero.pipeline.module",
    "ProcessTopology": "hf_zero.pipeline.topology", "PipeDataParallelTopology": "hf_zero.pipeline.topology",
    "PipeModelDataParallelTopology": "hf_zero.pipeline.topology",
    "PipelineParallelGrid": "hf_zero.pipeline.topology",
    "PipelineStageFailure": "hf_zero.pipeline.failure", "RepeatingLoader": "hf_zero.pipeline.data",
    "wrap": "hf_zero.pipeline.hf", "HFPipelineModule": "hf_zero.pipeline.hf",
    "from_pretrained": "hf_zero.pipeline.hf_load",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY, globals())
