"""``deepspeed.utils.tensor_fragment``: ``fragment_address`` (pickled in DeepSpeed's ZeRO-1/2 checkpoints; scripts
allow it with ``add_safe_globals``) and the safe_get_*/safe_set_*/safe_update_* accessors DeepSpeed defines here."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "fragment_address": "hf_zero.checkpoint.deepspeed_format:fragment_address",
    **{name: f"hf_zero.zero.tensor_fragment:{name}" for name in (
        "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
        "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
        "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
        "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
        "safe_update_full_grad_vectorized")},
})
