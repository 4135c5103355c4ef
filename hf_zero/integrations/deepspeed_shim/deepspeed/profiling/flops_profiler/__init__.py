"""``deepspeed.profiling.flops_profiler``: FlopsProfiler and get_model_profile, counted by hf_zero at the dispatcher
(true sizes under ZeRO-3, backward measured; see hf_zero/profiling/profiler.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_PROFILER = {
    "FlopsProfiler": "hf_zero.profiling.profiler:FlopsProfiler",
    "get_model_profile": "hf_zero.profiling.profiler:get_model_profile",
    "number_to_string": "hf_zero.profiling.report:number_to_string",
    "macs_to_string": "hf_zero.profiling.report:macs_to_string",
    "flops_to_string": "hf_zero.profiling.report:flops_to_string",
    "params_to_string": "hf_zero.profiling.report:params_to_string",
    "duration_to_string": "hf_zero.profiling.report:duration_to_string",
}

_forward(__name__, _PROFILER, submodules=["profiler"])
