"""hf_zero.runtime: the engine (``HfZeroEngine``, ``initialize``), checkpoints, optimizers and LR schedules.

Owns the training loop, the DeepSpeed engine API, and turning a config into the parts below it (ZeRO groups, the
stage-3 runtime, optimizer offload, loss scaling). May import pipeline, compression, zero, offload, profiling,
comm, ops and config; only integrations and the top-level modules import it (the layer table is ``LAYERS`` in
``tests/test_layering.py``).
"""
