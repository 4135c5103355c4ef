"""``deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr``: dynamic batching
(hf_zero/runtime/variable_batch.py)."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {name: f"hf_zero.runtime.variable_batch:{name}" for name in (
    "batch_by_seqlens", "scale_lr", "VariableBatchSizeLR", "dataloader_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed")})
