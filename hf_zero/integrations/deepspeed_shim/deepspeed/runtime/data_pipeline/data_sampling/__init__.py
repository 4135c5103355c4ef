"""``deepspeed.runtime.data_pipeline.data_sampling``: ``variable_batch_size_and_lr``
(hf_zero/runtime/variable_batch.py)."""
