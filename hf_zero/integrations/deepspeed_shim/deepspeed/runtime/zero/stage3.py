"""``deepspeed.runtime.zero.stage3``: the ZeRO-3 model-state estimators, with hf_zero's numbers,
``DeepSpeedZeroOptimizer_Stage3`` (an ``isinstance`` marker: hf_zero/integrations/ds_optimizer_types.py) and
``unwrap_model_for_generation`` (hf_zero/zero/gathered.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "DeepSpeedZeroOptimizer_Stage3": "hf_zero.integrations.ds_optimizer_types:DeepSpeedZeroOptimizer_Stage3",
    "unwrap_model_for_generation": "hf_zero.zero.gathered:unwrap_model_for_generation",
    "estimate_zero3_model_states_mem_needs_all_live":
        "hf_zero.profiling.ds_estimators:estimate_zero3_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs_all_cold":
        "hf_zero.profiling.ds_estimators:estimate_zero3_model_states_mem_needs_all_cold",
})
