"""``deepspeed.runtime.zero.stage_1_and_2``: the ZeRO-2 model-state estimators, with hf_zero's numbers, and
``DeepSpeedZeroOptimizer`` (an ``isinstance`` marker: hf_zero/integrations/ds_optimizer_types.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "DeepSpeedZeroOptimizer": "hf_zero.integrations.ds_optimizer_types:DeepSpeedZeroOptimizer",
    "estimate_zero2_model_states_mem_needs_all_live":
        "hf_zero.profiling.ds_estimators:estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero2_model_states_mem_needs_all_cold":
        "hf_zero.profiling.ds_estimators:estimate_zero2_model_states_mem_needs_all_cold",
})
