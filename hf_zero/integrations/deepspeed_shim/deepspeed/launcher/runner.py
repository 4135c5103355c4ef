"""``deepspeed.launcher.runner``: the name of the environment file DeepSpeed's multi-node launcher reads."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"DEEPSPEED_ENVIRONMENT_NAME": "hf_zero.integrations.compat:DEEPSPEED_ENVIRONMENT_NAME"})
