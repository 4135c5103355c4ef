"""``deepspeed.runtime.utils``: set_random_seed, move_to_device, see_memory_usage, clip_grad_norm_, get_global_norm,
empty_cache."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"set_random_seed": "hf_zero.runtime.seed:set_random_seed",
                    "move_to_device": "hf_zero.util.tensors:move_to_device",
                    **{name: f"hf_zero.integrations.ds_utils:{name}" for name in (
                        "see_memory_usage", "clip_grad_norm_", "get_global_norm", "empty_cache")}})
