"""hf_zero.parallel: the run's parallel layout -- :class:`ParallelDims` ``(dp, pp, tp)`` and the one DeviceMesh
every process group hf_zero uses comes from (ZeRO's data-parallel group, the tensor-parallel group, the pipeline's
stage and p2p groups, the groups gradient norms and losses are summed over).

Owns the layout only; what is applied on it (tensor parallelism, the pipeline cut, ZeRO) lives above. May import
comm and config; nothing else (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from hf_zero.parallel.dims import MESH_DIMS, ParallelDims, mesh_from_groups

__all__ = ["MESH_DIMS", "ParallelDims", "mesh_from_groups"]
