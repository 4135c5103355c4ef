"""DeepSpeed-Ulysses' ``DistributedAttention`` (``deepspeed.sequence.layer``): the Megatron-style wrapper that makes
any attention function sequence-parallel.

    attn = DistributedAttention(local_attention, sp_group, scatter_idx=2, gather_idx=0)
    context = attn(query, key, value, batch_dim_idx, rotary_pos_emb=None, *args, **kwargs)

``query``/``key``/``value`` arrive on each rank of ``sp_group`` with dimension ``gather_idx`` split (the sequence:
``[s/p, b, h, d]`` in Megatron's layout, the defaults). One all-to-all each trades that split for a split of
``scatter_idx`` (the heads), so ``local_attention(q, k, v, *args, **kwargs)`` sees the whole sequence for ``h/p``
heads; its output trades back to ``[s/p, b, h, d]``. Backward is the same exchanges reversed
(:func:`~hf_zero.sequence_parallel.all_to_all.seq_all_to_all`, bounded like every hf_zero collective).

``rotary_pos_emb=(cos, sin)`` (each ``[b, s, 1, rot]`` as Megatron-DeepSpeed passes them) is applied to the
exchanged query and key, on the whole sequence, over their first ``rot`` channels.

Differences from DeepSpeed, each said where it applies: heads must divide by the SP size (DeepSpeed also cuts
uneven GQA head counts: refused here naming the shape); ``sp_stream`` (DeepSpeed's CUDA overlap of the q/k/v
exchanges with the projections) is accepted with a warning and the exchanges run on the current stream.
``batch_dim_idx`` picks DeepSpeed's buffer layout; the exchange here needs none, so it is only range-checked.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from hf_zero.ops.transformer import apply_rotary
from hf_zero.sequence_parallel.all_to_all import seq_all_to_all

__all__ = ["DistributedAttention", "apply_rotary_pos_emb"]

logger = logging.getLogger("hf_zero")


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first ``cos.shape[-1]`` channels of ``t`` (the rest pass through): hf_zero's fused
    ``apply_rotary`` (``t * cos + rotate_half(t) * sin``), with ``cos``/``sin`` broadcasting against ``t``."""
    rot = cos.shape[-1]
    head, tail = t[..., :rot], t[..., rot:]
    head = apply_rotary(head, cos, sin)
    return head if tail.shape[-1] == 0 else torch.cat((head, tail), dim=-1)


class DistributedAttention(nn.Module):
    """``local_attention`` made sequence-parallel over ``sequence_process_group`` (see the module docstring)."""

    def __init__(self, local_attention: nn.Module, sequence_process_group, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream=None, num_kv_heads: int | None = None) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.num_kv_heads = num_kv_heads
        self.sp_stream = sp_stream
        if sp_stream is not None:
            logger.warning("hf_zero: DistributedAttention(sp_stream=...): DeepSpeed overlaps the q/k/v all-to-alls "
                           "with the projections on that CUDA stream; hf_zero runs them on the current stream "
                           "(same results, no overlap)")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int,
                rotary_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        if not 0 <= batch_dim_idx < query.dim() or batch_dim_idx in (self.scatter_idx, self.gather_idx):
            raise ValueError(f"DistributedAttention: batch_dim_idx {batch_dim_idx} is not a dimension of the "
                             f"{tuple(query.shape)} query other than the exchanged ones (scatter_idx "
                             f"{self.scatter_idx}, gather_idx {self.gather_idx})")
        world = torch.distributed.get_world_size(self.spg)
        kv_heads = self.num_kv_heads if self.num_kv_heads is not None else key.shape[self.scatter_idx]
        if kv_heads % world or query.shape[self.scatter_idx] % world:
            raise ValueError(f"DistributedAttention: {query.shape[self.scatter_idx]} query / {kv_heads} key-value "
                             f"heads (dimension {self.scatter_idx}) do not split over the {world} ranks of the "
                             "sequence-parallel group; hf_zero needs both divisible (DeepSpeed also cuts uneven "
                             "GQA head counts)")

        def exchange(t: torch.Tensor) -> torch.Tensor:
            return seq_all_to_all(t, self.spg, scatter_dim=self.scatter_idx, gather_dim=self.gather_idx)

        q, k, v = exchange(query), exchange(key), exchange(value)
        if rotary_pos_emb is not None:
            # Megatron-DeepSpeed hands cos/sin as [b, s, 1, rot]; the exchanged tensors are sequence-first
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.spg, scatter_dim=self.gather_idx, gather_dim=self.scatter_idx)
