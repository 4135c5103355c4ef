"""``deepspeed.runtime.data_pipeline``: the dynamic-batching part of DeepSpeed's data efficiency
(``data_sampling.variable_batch_size_and_lr``)."""
