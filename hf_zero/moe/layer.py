"""``MoE``: DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``), with expert parallelism.

    self.moe = MoE(hidden_size=512, expert=MLP(512), num_experts=8, k=2)
    out, l_aux, exp_counts = self.moe(hidden)          # hidden (..., hidden_size)
    loss = task_loss + 0.01 * l_aux

Forward (``MOELayer``), for ``s`` tokens of width ``m``, ``e`` experts of capacity ``c``::

    gate:      combine (s, e, c), dispatch (s, e, c)
    dispatch:  einsum("sec,sm->ecm")          each expert's slots filled with its tokens (zeros where empty)
    experts:   expert i runs on its (c, m) slots
    combine:   einsum("sec,ecm->sm")          each token's output = gate-weighted sum of its experts' outputs

Expert parallelism (``ep_size > 1``): this rank holds ``num_local = e / ep_size`` experts, those of its EP rank
(hf_zero/comm/expert_groups.py). Every rank still gates its own tokens over all ``e`` experts; the dispatched
``(e, c, m)`` buffer is exchanged with one all-to-all over the EP group before the experts run and once more after::

    dispatched (e, c, m) = (ep_size, num_local, c, m)   block j: this rank's tokens for EP rank j's experts
    all-to-all            -> (ep_size, num_local, c, m)  block i: EP rank i's tokens for *this* rank's experts
    experts               expert l runs on [:, l] (every rank's slots for it)
    all-to-all            -> (e, c, m)                   block j: EP rank j's experts' outputs for this rank's tokens

The all-to-all is its own backward (gradients go back the way the tokens came). The groups are created by the
engine at initialize (``set_deepspeed_parallelism``, as DeepSpeed's engine does).

Expert parameters carry DeepSpeed's marks (``allreduce = False``, ``group_name = "ep_size_<n>"``) that
``split_params_into_different_moe_groups_for_optimizer`` sorts on, and the engine reduces their gradients over
the expert-data-parallel group.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hf_zero.comm import all_to_all_single_
from hf_zero.comm.expert_groups import create_expert_and_data_parallel

from hf_zero.moe.gating import TopKGate

__all__ = ["MoE", "MOELayer", "Experts"]


class _AllToAll(torch.autograd.Function):
    """The equal-split all-to-all over ``group`` (dim 0 in ``world_size`` blocks); its gradient is the same exchange
    of the output's gradient."""

    @staticmethod
    def forward(ctx, group, what: str, tokens: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.what = group, what
        tokens = tokens.contiguous()
        out = torch.empty_like(tokens)
        all_to_all_single_(out, tokens, group=group, what=what)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, _AllToAll.apply(ctx.group, f"the backward of {ctx.what}", grad)


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
        self.ep_group = None  # with ep_size > 1: this rank's expert-parallel group (_set_ep_group)
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"MoE(ep_size={self.ep_size}): no expert-parallel group yet; the engine creates it at "
                               "initialize (hf_zero.initialize / deepspeed.initialize with this model), or call "
                               "moe.set_deepspeed_parallelism() on every rank first")
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)  # (s, m)
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(hidden), tokens)  # (e, c, m)
        if self.ep_size > 1:
            dispatched = _AllToAll.apply(self.ep_group, f"the MoE token dispatch of {self.ep_group_name}", dispatched)
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_out = self.experts(dispatched).reshape(self.ep_size * self.num_local_experts, -1, d_model)
        if self.ep_size > 1:
            expert_out = _AllToAll.apply(self.ep_group, f"the MoE expert combine of {self.ep_group_name}", expert_out)
        combined = torch.einsum("sec,ecm->sm", combine_weights.type_as(hidden), expert_out)
        return combined.reshape(hidden.shape)


class MoE(nn.Module):
    """DeepSpeed's ``MoE`` layer; same constructor. ``forward(hidden_states, used_token=None)`` returns
    ``(output, l_aux, exp_counts)``.

    ``use_residual``: Residual-MoE -- the output mixes the MoE output with a dense copy of ``expert`` through a
    learned 2-way softmax coefficient. ``ep_size``: ranks the experts are spread over (must divide ``num_experts``
    and the world size); ``use_tutel`` and ``enable_expert_tensor_parallelism`` are refused.
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
            raise ValueError(f"MoE: ep_size={ep_size!r} must be a positive integer")
        if num_experts < 1 or num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} must be >= 1 and divisible by ep_size={ep_size} "
                             f"(each of the {ep_size} expert-parallel ranks holds num_experts / ep_size experts)")
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

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (once per ep_size) the expert-parallel groups and give this layer its own; collective over the
        world. The engine calls it at initialize for every module that has it, as DeepSpeed's does."""
        if self.ep_size == 1 and not torch.distributed.is_initialized():
            return  # data-parallel experts in one process: no group to create, none needed
        groups = create_expert_and_data_parallel(self.ep_size, use_data_before_expert_parallel_)
        if self.ep_size > 1:
            self.deepspeed_moe._set_ep_group(groups.ep_group)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
