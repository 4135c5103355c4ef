"""``deepspeed.utils.zero_to_fp32``: consolidate a ZeRO checkpoint into one fp32 state dict, offline ->
``hf_zero.checkpoint.zero_to_fp32`` (reads hf_zero's checkpoint layout; docs/deepspeed_names.md says what differs)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.checkpoint.zero_to_fp32:{name}" for name in (
    "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict")})
