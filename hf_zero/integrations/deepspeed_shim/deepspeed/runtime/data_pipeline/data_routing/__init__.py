"""``deepspeed.runtime.data_pipeline.data_routing``: random layer-token drop (hf_zero/runtime/random_ltd.py)."""
