"""``deepspeed.runtime.data_pipeline.data_routing.helper`` (hf_zero/runtime/random_ltd.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.runtime.random_ltd:{name}" for name in (
    "convert_to_random_ltd", "save_without_random_ltd", "remove_random_ltd_state_dict", "RandomLayerTokenDrop")})
