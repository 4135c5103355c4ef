"""hf_zero.runtime: the engine (``HfZeroEngine``, ``initialize``), checkpoints, optimizers and LR schedules.

Owns the training loop, the DeepSpeed engine API, and turning a config into the parts below it (ZeRO groups, the
stage-3 runtime, optimizer offload, loss scaling) on the run's parallel layout (parallelize.py). May import
pipeline, compression, tensor_parallel, zero, offload, profiling, parallel, comm, ops and config; only integrations and the top-level modules import it (the layer table is ``LAYERS`` in
``tests/test_layering.py``).
"""
