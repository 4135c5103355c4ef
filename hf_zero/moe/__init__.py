"""Mixture-of-experts layers with DeepSpeed's interface (``deepspeed.moe.layer.MoE`` forwards here).

- ``gating.py``: DeepSpeed's top-1 / top-2 gating with expert capacity, token dropping and the load-balancing loss.
- ``layer.py``: ``MoE`` (gate + experts + optional residual MLP), ``MOELayer`` and ``Experts``; parameter names
  match DeepSpeed's (``deepspeed_moe.gate.wg``, ``deepspeed_moe.experts.deepspeed_experts.N``) so checkpoints map.
- ``groups.py``: ``is_moe_param`` and ``split_params_into_different_moe_groups_for_optimizer``.

Experts are data-parallel (``ep_size=1``: every rank holds every expert and the engine averages their gradients
like any other parameter's). Expert parallelism (``ep_size > 1``, experts spread over ranks with all-to-all token
exchange) is refused with an error naming ``ep_size``.

Bottom layer: imports no other hf_zero package (the layer table is ``LAYERS`` in ``tests/test_layering.py``).
"""

from __future__ import annotations

from hf_zero.moe.groups import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from hf_zero.moe.layer import MoE, Experts, MOELayer
from hf_zero.moe.gating import TopKGate

__all__ = ["MoE", "MOELayer", "Experts", "TopKGate", "is_moe_param",
           "split_params_into_different_moe_groups_for_optimizer"]
