"""hf_zero.compression: quantization, pruning and distillation for fine-tuning, driven by the DeepSpeed-format
``compression_training`` config section.

    from hf_zero.compression import init_compression, redundancy_clean, CompressionScheduler
    model = init_compression(model, "ds_config.json")      # compression inserted for training
    trainer = Trainer(model, ..., callbacks=[CompressionCallback("ds_config.json", clean_at_end=True)])
    trainer.train()                                          # schedules stepped; cleaned at the end
    export_int8(model)                                       # real int8 linears for CPU inference

One folder per grouped method (``config.py`` schema, ``layer.py`` transform, ``apply.py`` install / clean plan),
registered by name in :mod:`hf_zero.compression.registry`. Names are imported lazily: ``import hf_zero`` stays cheap.

May import zero (to gather ZeRO-3 partitions it transforms), offload, profiling, comm, ops and config; never runtime
or integrations (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from __future__ import annotations

from hf_zero.util import lazy_exports

_LAZY = {
    "init_compression": "hf_zero.compression.compress",
    "redundancy_clean": "hf_zero.compression.compress",
    "CompressionScheduler": "hf_zero.compression.compress",
    "load_compression_config": "hf_zero.compression.compress",
    "weight_sparsity": "hf_zero.compression.compress",
    "parse_compression_config": "hf_zero.compression.config",
    "CompressionConfig": "hf_zero.compression.config",
    "CompressedLinear": "hf_zero.compression.layer",
    "export_int8": "hf_zero.compression.export",
    "export_bnb": "hf_zero.compression.export",
    "Int8Linear": "hf_zero.compression.export",
    "quantize_weights": "hf_zero.compression.ptq",
    "CompressionCallback": "hf_zero.compression.callbacks",
    "DistillationTrainer": "hf_zero.compression.distillation",
    "distillation_loss": "hf_zero.compression.distillation",
    "student_initialization": "hf_zero.compression.layer_reduction.apply",
    "make_student": "hf_zero.compression.layer_reduction.apply",
    "write_model_card": "hf_zero.compression.model_card",
}

__all__ = list(_LAZY)


__getattr__ = lazy_exports(__name__, _LAZY, globals())
