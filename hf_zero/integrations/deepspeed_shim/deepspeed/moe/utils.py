"""``deepspeed.moe.utils``: is_moe_param, split_params_into_different_moe_groups_for_optimizer."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "is_moe_param": "hf_zero.moe.groups:is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer":
        "hf_zero.moe.groups:split_params_into_different_moe_groups_for_optimizer",
})
