"""hf_zero.profiling: true parameter counts, FLOPs counted at the dispatcher, MFU, memory and step-time estimates,
and the per-phase wall-clock timers (``timers``) zero, offload and the engine time themselves with.

This package sits below ``zero`` and ``offload`` in the layering: it imports nothing above comm (the layer table is
``LAYERS`` in ``tests/test_layering.py``); it reads ZeRO-3's sharded-parameter records through the ``ds_*``
attributes they publish. Names are imported on first use so ``import hf_zero.profiling`` stays cheap.
"""

from __future__ import annotations

from hf_zero.util import lazy_exports

_LAZY = {
    "count_params": "hf_zero.profiling.params",
    "ParamCounts": "hf_zero.profiling.params",
    "count_flops": "hf_zero.profiling.flops",
    "FlopCounter": "hf_zero.profiling.flops",
    "FlopReport": "hf_zero.profiling.flops",
    "analytic_flops": "hf_zero.profiling.analytic",
    "get_model_profile": "hf_zero.profiling.profiler",
    "FlopsProfiler": "hf_zero.profiling.profiler",
    "estimate_memory": "hf_zero.profiling.memory",
    "estimate_step_time": "hf_zero.profiling.steptime",
    "peak_tflops": "hf_zero.profiling.hardware",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY, globals())
