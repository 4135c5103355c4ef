"""``deepspeed.utils.logging``: logger (hf_zero's), log_dist, print_dist."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "logger": "hf_zero.integrations.compat:logger",
    "log_dist": "hf_zero.integrations.ds_utils:log_dist",
    "print_dist": "hf_zero.integrations.ds_utils:print_dist",
})
