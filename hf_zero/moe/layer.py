"""``MoE``: DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``), data-parallel experts.

    self.moe = MoE(hidden_size=512, expert=MLP(512), num_experts=8, k=2)
    out, l_aux, exp_counts = self.moe(hidden)          # hidden (..., hidden_size)
    loss = task_loss + 0.01 * l_aux

Forward (``MOELayer``), for ``s`` tokens of width ``m``, ``e`` experts of capacity ``c``::

    gate:      combine (s, e, c), dispatch (s, e, c)
    dispatch:  einsum("sec,sm->ecm")          each expert's slots filled with its tokens (zeros where empty)
    experts:   expert i runs on its (c, m) slots
    combine:   einsum("sec,ecm->sm")          each token's output = gate-weighted sum of its experts' outputs

Expert parameters carry DeepSpeed's marks (``allreduce = False``, ``group_name = "ep_size_<n>"``) that
``split_params_into_different_moe_groups_for_optimizer`` sorts on.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hf_zero.moe.gating import TopKGate

__all__ = ["MoE", "MOELayer", "Experts"]


class Experts(nn.Module):
    """``num_local_experts`` independent copies of ``expert``; input (ep, num_local_experts, c, m)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False  # DeepSpeed's mark of an expert parameter (is_moe_param)
                p.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (see the module docstring). ``l_aux`` and ``exp_counts`` of the last
    forward are kept on the module, as DeepSpeed's are."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)  # (s, m)
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(hidden), tokens)  # (e, c, m)
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_out = self.experts(dispatched).reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined = torch.einsum("sec,ecm->sm", combine_weights.type_as(hidden), expert_out)
        return combined.reshape(hidden.shape)


class MoE(nn.Module):
    """DeepSpeed's ``MoE`` layer; same constructor. ``forward(hidden_states, used_token=None)`` returns
    ``(output, l_aux, exp_counts)``.

    ``use_residual``: Residual-MoE -- the output mixes the MoE output with a dense copy of ``expert`` through a
    learned 2-way softmax coefficient. ``ep_size`` must be 1 (data-parallel experts); ``use_tutel`` and
    ``enable_expert_tensor_parallelism`` are refused.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if ep_size != 1:
            raise NotImplementedError(
                f"MoE(ep_size={ep_size}): hf_zero runs data-parallel experts only (every rank holds all "
                f"{num_experts} experts); expert parallelism with all-to-all token exchange is not implemented. "
                "Use ep_size=1")
        if num_experts < 1 or num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} must be >= 1 and divisible by ep_size={ep_size}")
        if use_tutel:
            raise NotImplementedError("MoE(use_tutel=True): Tutel's fused kernels are not available in hf_zero; "
                                      "use use_tutel=False (same results, DeepSpeed's einsum path)")
        if enable_expert_tensor_parallelism:
            raise NotImplementedError("MoE(enable_expert_tensor_parallelism=True) is not supported by hf_zero")
        self.use_residual = use_residual
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
