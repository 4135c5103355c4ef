"""DeepSpeed's top-k gating (GShard / Switch): which expert each token goes to, at which slot, with what weight.

Shapes: ``s`` tokens, ``e`` experts, ``c`` capacity (slots per expert), ``m`` model dim.

    logits (s, e) -> combine_weights (s, e, c) float, dispatch_mask (s, e, c) bool, l_aux (), exp_counts (e,)

Capacity is ``ceil(s / e * capacity_factor)`` (top-2: ``2 * capacity_factor``), at least ``min_capacity``. With
``drop_tokens`` a token routed to a full expert is dropped (its combine weight is 0, the layer outputs 0 for it);
without, the capacity grows to the busiest expert's count. ``l_aux`` is the load-balancing loss (mean gate
probability times fraction of tokens, per expert). Random parts -- ``use_rts`` (random token selection when an
expert overflows), ``noisy_gate_policy`` ('Jitter' input noise, 'RSample' Gumbel logits noise) and top-2's
sampled second expert -- draw from torch's generator (noise policies in training only), as in DeepSpeed. With
expert parallelism and ``drop_tokens=False`` the capacity is the busiest expert's count over the expert-parallel
group (its ranks exchange equal blocks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hf_zero.comm import all_reduce_, bookkeeping_device

__all__ = ["TopKGate", "top1gating", "top2gating"]

_EPS = torch.finfo(torch.float32).eps


def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    return max(int(math.ceil(num_tokens / num_experts * capacity_factor)), int(min_capacity))


def _gumbel(shape, device) -> torch.Tensor:
    u = torch.rand(shape, device=device).clamp_(min=1e-20, max=1 - 1e-7)
    return -torch.log(-torch.log(u))


def _one_hot(index: torch.Tensor, num_classes: int) -> torch.Tensor:
    return F.one_hot(index, num_classes=num_classes).to(torch.int64)


def _keep_top(mask: torch.Tensor, capacity: int, use_rts: bool) -> torch.Tensor:
    """``mask`` (s, e) 0/1: keep at most ``capacity`` tokens per expert (random ones with ``use_rts``, else the
    first ones by topk's order)."""
    scores = mask * torch.rand_like(mask, dtype=torch.float32) if use_rts else mask.float()
    k = min(capacity, mask.shape[0])
    top = torch.topk(scores, k=k, dim=0).indices  # (k, e)
    return mask * torch.zeros_like(mask).scatter_(0, top, 1)


def _busiest(exp_counts: torch.Tensor, ep_group) -> int:
    """Capacity without token dropping: the busiest expert's count -- over the expert-parallel group, whose ranks
    exchange equal blocks of ``capacity`` slots per expert (DeepSpeed all-reduces the max there too)."""
    busiest = exp_counts.max().reshape(1).to(torch.int64)
    if ep_group is not None:
        busiest = busiest.to(bookkeeping_device(ep_group))  # NCCL reduces device tensors, gloo host ones
        all_reduce_(busiest, group=ep_group, op=torch.distributed.ReduceOp.MAX,
                    what="the MoE capacity all-reduce (drop_tokens=False)")
    return max(int(busiest.item()), 1)


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True, ep_group=None):
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    chooser = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask1 = _one_hot(torch.argmax(chooser, dim=1), num_experts)  # (s, e)
    if used_token is not None:
        mask1 = mask1 * used_token.reshape(-1, 1).to(mask1.dtype)
    exp_counts = mask1.sum(dim=0).detach().to("cpu")
    if not drop_tokens:
        capacity = _busiest(exp_counts, ep_group)
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = (me * ce).sum() * num_experts
    mask1 = _keep_top(mask1, capacity, use_rts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations1_s = (locations1 * mask1).sum(dim=1)
    gates = gates * mask1.float()
    locations1_sc = _one_hot(locations1_s, capacity).float()  # (s, c)
    combine_weights = torch.einsum("se,sc->sec", gates, locations1_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               top2_2nd_expert_sampling: bool = True, ep_group=None):
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    capacity = _capacity(num_tokens, num_experts, 2 * capacity_factor, min_capacity)
    mask1 = _one_hot(torch.argmax(gates, dim=1), num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    mask2 = _one_hot(torch.argmax(logits_except1, dim=1), num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second choices queue after firsts
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = (me * ce).mean() * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach().to("cpu")
    if drop_tokens:
        mask1 = mask1 * (locations1 < capacity)
        mask2 = mask2 * (locations2 < capacity)
    else:
        capacity = _busiest(exp_counts, ep_group)
    locations1_s = (locations1 * mask1).sum(dim=1)
    locations2_s = (locations2 * mask2).sum(dim=1)
    mask1_f, mask2_f = mask1.float(), mask2.float()
    gates1_s = torch.einsum("se,se->s", gates, mask1_f)
    gates2_s = torch.einsum("se,se->s", gates, mask2_f)
    denom_s = torch.clamp(gates1_s + gates2_s, min=_EPS)
    gates1 = torch.einsum("s,se->se", gates1_s / denom_s, mask1_f)
    gates2 = torch.einsum("s,se->se", gates2_s / denom_s, mask2_f)
    combine_weights = (torch.einsum("se,sc->sec", gates1, _one_hot(locations1_s, capacity).float())
                       + torch.einsum("se,sc->sec", gates2, _one_hot(locations2_s, capacity).float()))
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


class TopKGate(nn.Module):
    """The router: a bias-free fp32 linear layer ``wg`` (model_dim -> num_experts) and top-1/top-2 gating."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"MoE: k={k}; only top-1 and top-2 gating are supported (as in DeepSpeed)")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"MoE: noisy_gate_policy={noisy_gate_policy!r}; use None, 'Jitter' or 'RSample'")
        if k == 2 and noisy_gate_policy == "RSample":
            raise ValueError("MoE: noisy_gate_policy='RSample' is a top-1 policy; with k=2 use None or 'Jitter'")
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.ep_group = None  # set with expert parallelism (MOELayer._set_ep_group)

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None):
        x = x.float()  # routing decisions in fp32, as DeepSpeed's gate
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x, self.wg.weight.float())  # fp32 even where the engine cast the weight to 16 bit
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group)
        return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling,
                          self.ep_group)
