"""``deepspeed.sequence.layer.DistributedAttention`` (DeepSpeed-Ulysses' Megatron-style wrapper) on 2 and 4 gloo
ranks: each rank's slice of the output and of the input gradients equals the same slice of one process running the
attention on the whole sequence (Megatron's [s, b, h, d] layout and a batch-first one; with rotary embeddings)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_zero.testing import run_distributed

S, B, H, D, ROT = 8, 2, 4, 6, 4


def _sdpa_seq_first(q, k, v, causal=True):
    """Attention over [s, b, h, d] tensors (the local attention Megatron hands DistributedAttention)."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=causal)
    return out.permute(2, 0, 1, 3)


def _sdpa_batch_first(q, k, v):
    """[b, s, h, d]."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


def _inputs(batch_first: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, B, H, D, generator=g) for _ in range(3))
    w = torch.randn(S, B, H, D, generator=g)  # the loss's weights: sum(out * w)
    freqs = torch.randn(B, S, 1, ROT, generator=g)
    cos, sin = freqs.cos(), freqs.sin()
    if batch_first:
        q, k, v, w = (t.transpose(0, 1).contiguous() for t in (q, k, v, w))
    return q, k, v, w, (cos, sin)


def _reference(batch_first: bool, rotary: bool):
    from hf_zero.sequence_parallel.distributed_attention import apply_rotary_pos_emb

    q, k, v, w, (cos, sin) = _inputs(batch_first)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    qq, kk = q, k
    if rotary:  # DeepSpeed's convention: cos/sin [b, s, 1, rot], applied sequence-first
        c, s_ = cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3)
        if batch_first:
            c, s_ = c.transpose(0, 1), s_.transpose(0, 1)
        qq, kk = apply_rotary_pos_emb(q, c, s_), apply_rotary_pos_emb(k, c, s_)
    out = (_sdpa_batch_first if batch_first else _sdpa_seq_first)(qq, kk, v)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _sharded(batch_first: bool, rotary: bool):
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    rank, world = dist.get_rank(), dist.get_world_size()
    seq_dim = 1 if batch_first else 0
    q, k, v, w, rope = _inputs(batch_first)
    mine = [t.chunk(world, dim=seq_dim)[rank].clone().requires_grad_() for t in (q, k, v)]
    attn = DistributedAttention(_sdpa_batch_first if batch_first else _sdpa_seq_first, dist.group.WORLD,
                                scatter_idx=2, gather_idx=seq_dim)
    out = attn(*mine, 0 if batch_first else 1, rope if rotary else None)
    (out * w.chunk(world, dim=seq_dim)[rank]).sum().backward()
    assert deepspeed.sequence.layer.DistributedAttention is DistributedAttention
    return out.detach(), *(t.grad for t in mine)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("batch_first,rotary", [(False, False), (False, True), (True, False)])
def test_each_rank_holds_its_slice_of_whole_sequence_attention(world_size, batch_first, rotary):
    ref = _reference(batch_first, rotary)
    results = run_distributed(_sharded, world_size, args=(batch_first, rotary))
    seq_dim = 1 if batch_first else 0
    for rank, got in enumerate(results):
        for name, full, part in zip(("output", "dq", "dk", "dv"), ref, got):
            torch.testing.assert_close(part, full.chunk(world_size, dim=seq_dim)[rank], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def _uneven_heads():
    from deepspeed.sequence.layer import DistributedAttention

    attn = DistributedAttention(_sdpa_seq_first, dist.group.WORLD)
    q = torch.randn(S // 2, B, 3, D)  # 3 heads over 2 ranks
    with pytest.raises(ValueError, match=r"3 query / 3 key-value heads .* do not split over the 2 ranks"):
        attn(q, q, q, 1)
    with pytest.raises(ValueError, match="batch_dim_idx 2"):
        attn(q, q, q, 2)
    return True


def test_uneven_heads_and_a_bad_batch_dim_are_refused_by_name():
    assert run_distributed(_uneven_heads, 2) == [True, True]
