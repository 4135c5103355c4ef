"""DeepSpeed's ``deepspeed.pipe`` names, answered by :mod:`hf_zero.pipeline` (the shim maps ``deepspeed.pipe``
here)."""

from hf_zero.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from hf_zero.pipeline.topology import (PipeDataParallelTopology, PipelineParallelGrid,
                                       PipeModelDataParallelTopology, ProcessTopology)

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "PipelineParallelGrid"]
