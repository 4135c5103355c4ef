"""``deepspeed.runtime.engine.DeepSpeedEngine`` is ``hf_zero.runtime.engine.HfZeroEngine``; DeepSpeed's optimizer and
scheduler callable type aliases."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"DeepSpeedEngine": "hf_zero.runtime.engine:HfZeroEngine",
                    "DeepSpeedOptimizerCallable": "hf_zero.integrations.ds_utils:DeepSpeedOptimizerCallable",
                    "DeepSpeedSchedulerCallable": "hf_zero.integrations.ds_utils:DeepSpeedSchedulerCallable"})
