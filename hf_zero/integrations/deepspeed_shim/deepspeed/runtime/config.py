"""``deepspeed.runtime.config``: DeepSpeedConfig, over hf_zero's config parsing (``hf_zero.integrations.ds_config``)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"DeepSpeedConfig": "hf_zero.integrations.ds_config:DeepSpeedConfig",
                    "DeepSpeedConfigError": "hf_zero.config.errors:ConfigError"})
