"""``deepspeed.utils``: logger, set_z3_leaf_modules, is_initialized and the ``groups`` module."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "logger": "hf_zero.integrations.compat:logger",
    "set_z3_leaf_modules": "hf_zero.zero:set_z3_leaf_modules",
    "is_initialized": "hf_zero.comm:is_initialized",
}, submodules=["groups"])
