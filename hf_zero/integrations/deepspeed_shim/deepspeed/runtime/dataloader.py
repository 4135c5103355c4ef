"""``deepspeed.runtime.dataloader``: RepeatingLoader (``hf_zero.pipeline.data``) and DeepSpeedDataLoader, the loader
``initialize(training_data=...)`` builds (``hf_zero.runtime.dataloader``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"RepeatingLoader": "hf_zero.pipeline.data:RepeatingLoader",
                    "DeepSpeedDataLoader": "hf_zero.runtime.dataloader:DeepSpeedDataLoader"})
