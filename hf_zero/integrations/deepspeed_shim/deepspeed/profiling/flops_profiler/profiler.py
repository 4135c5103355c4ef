"""``deepspeed.profiling.flops_profiler.profiler``: the same names as its package."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward
from deepspeed.profiling.flops_profiler import _PROFILER

_forward(__name__, _PROFILER)
