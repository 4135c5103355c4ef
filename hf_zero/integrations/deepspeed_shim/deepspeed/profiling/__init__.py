"""``deepspeed.profiling``: the FLOPs profiler (hf_zero/profiling)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["flops_profiler"])
