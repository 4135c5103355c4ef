"""hf_zero.zero: ZeRO partitioning. ``Init``, ``GatheredParameters`` and ``register_external_parameter`` are the
DeepSpeed-compatible entry points, with ``TiledLinear`` (a linear layer ZeRO-3 gathers tile by tile); they are
imported on first use so ``import hf_zero.zero`` stays cheap.

Owns what a rank's shard of each parameter is (layouts, ``ShardedParam`` and its states), the stage 0-2 groups,
gradient reduction, the sharded optimizer step, fp16 loss scaling and the ZeRO-3 gather/release runtime. May import
offload (the swapped storage it declares the interface of), profiling, comm, ops and config; never runtime,
integrations, compression or pipeline (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_zero.util import lazy_exports

_LAZY = {
    "Init": "hf_zero.zero.init",
    "GatheredParameters": "hf_zero.zero.gathered",
    "register_external_parameter": "hf_zero.zero.gathered",
    "unregister_external_parameter": "hf_zero.zero.gathered",
    "set_z3_leaf_modules": "hf_zero.zero.leaf",
    "unset_z3_leaf_modules": "hf_zero.zero.leaf",
    "get_z3_leaf_modules": "hf_zero.zero.leaf",
    "set_z3_leaf_module": "hf_zero.zero.leaf",
    "set_z3_leaf_modules_by_name": "hf_zero.zero.leaf",
    "set_z3_leaf_modules_by_suffix": "hf_zero.zero.leaf",
    "z3_leaf_module": "hf_zero.zero.leaf",
    "z3_leaf_parameter": "hf_zero.zero.leaf",
    "TiledLinear": "hf_zero.zero.tiling",
    "TiledLinearReturnBias": "hf_zero.zero.tiling",
}

__all__ = list(_LAZY)

if TYPE_CHECKING:
    from hf_zero.zero.gathered import GatheredParameters, register_external_parameter, unregister_external_parameter
    from hf_zero.zero.init import Init
    from hf_zero.zero.leaf import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                                   set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                                   unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
    from hf_zero.zero.tiling import TiledLinear, TiledLinearReturnBias


__getattr__ = lazy_exports(__name__, _LAZY, globals())
