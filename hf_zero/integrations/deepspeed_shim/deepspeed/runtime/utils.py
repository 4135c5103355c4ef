"""``deepspeed.runtime.utils``: set_random_seed, move_to_device."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"set_random_seed": "hf_zero.runtime.seed:set_random_seed",
                    "move_to_device": "hf_zero.util.tensors:move_to_device"})
