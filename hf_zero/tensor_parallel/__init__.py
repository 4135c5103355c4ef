"""Tensor parallelism for Hugging Face models on DTensor (``torch.distributed.tensor.parallel``).

    from hf_zero.tensor_parallel import build_mesh, apply_tp
    mesh = build_mesh(tp_size=2)                 # the run's (pp, dp, tp) mesh, pp 1; tp innermost
    apply_tp(model, mesh.tp_mesh)                # q/k/v, up/gate column parallel; o/down row parallel;
                                                 # embedding and LM head vocabulary parallel
    loss = model(input_ids, labels=labels).loss  # vocabulary-parallel cross-entropy; no rank holds full logits

    apply_tp(model, mesh.tp_mesh, sequence_parallel=True)  # also split norms / residual stream along the sequence

Owns the TP view of the run's mesh (hf_zero.parallel), the per-module sharding plans and the vocabulary-parallel
loss. May import zero, offload, profiling, parallel, comm, ops and config; never runtime (which wires it in), integrations, or its peers pipeline and
compression (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from hf_zero.tensor_parallel.apply import TPInfo, apply_tp, tp_info
from hf_zero.tensor_parallel.loss import VocabParallelCausalLMLoss, vocab_parallel_cross_entropy
from hf_zero.tensor_parallel.mesh import TPMesh, build_mesh
from hf_zero.tensor_parallel.model_init import tp_model_init
from hf_zero.tensor_parallel.plans import OWN_PLANS, resolve_plan
from hf_zero.tensor_parallel.sequence import SP_PLANS

__all__ = ["apply_tp", "tp_model_init", "tp_info", "TPInfo", "build_mesh", "TPMesh", "vocab_parallel_cross_entropy",
           "VocabParallelCausalLMLoss", "OWN_PLANS", "SP_PLANS", "resolve_plan"]
