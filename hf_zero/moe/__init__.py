"""Mixture-of-experts layers with DeepSpeed's interface (``deepspeed.moe.layer.MoE`` forwards here).

- ``gating.py``: DeepSpeed's top-1 / top-2 gating with expert capacity, token dropping and the load-balancing loss.
- ``layer.py``: ``MoE`` (gate + experts + optional residual MLP), ``MOELayer`` and ``Experts``; parameter names
  match DeepSpeed's (``deepspeed_moe.gate.wg``, ``deepspeed_moe.experts.deepspeed_experts.N``) so checkpoints map.
- ``groups.py``: ``is_moe_param`` and ``split_params_into_different_moe_groups_for_optimizer``.
- ``state.py``: expert-parallel layers' state dicts under global expert indices (checkpoints, 16-bit saves).

Expert parallelism (``ep_size > 1``): each rank holds ``num_experts / ep_size`` experts -- those of its place in
its expert-parallel group (hf_zero/comm/expert_groups.py, DeepSpeed's rank layout) -- and tokens travel to them and
back with an all-to-all over that group. The engine creates the groups at initialize, reduces expert gradients over
the ranks holding the same experts and shards their optimizer state there (ZeRO stages 0-2; hf_zero/runtime/
moe_setup.py). With ``ep_size=1`` experts are data-parallel: every rank holds all of them and the engine treats
them like any other parameter (also at ZeRO stage 3, which refuses ``ep_size > 1`` as DeepSpeed refuses native
MoE there).

Layer 2: it imports comm only, for the expert-parallel groups and the all-to-all (the layer table is ``LAYERS`` in
``tests/test_layering.py``).
"""

from __future__ import annotations

from hf_zero.moe.groups import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from hf_zero.moe.layer import MoE, Experts, MOELayer
from hf_zero.moe.gating import TopKGate

__all__ = ["MoE", "MOELayer", "Experts", "TopKGate", "is_moe_param",
           "split_params_into_different_moe_groups_for_optimizer"]
