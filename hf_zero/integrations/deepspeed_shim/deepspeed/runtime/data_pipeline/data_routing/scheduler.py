"""``deepspeed.runtime.data_pipeline.data_routing.scheduler`` (hf_zero/runtime/random_ltd.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"RandomLTDScheduler": "hf_zero.runtime.random_ltd:RandomLTDScheduler"})
