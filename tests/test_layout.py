"""The shard layout: pack/unpack are inverses, and a packed reduce-scatter / all-gather gives each rank its shards."""

import torch
import torch.distributed as dist

from hf_zero.comm import all_gather_packed, reduce_scatter_packed
from hf_zero.testing import run_distributed
from hf_zero.zero.layout import ShardLayout

NUMELS = (5, 3, 1, 8, 7)


def test_layout_offsets_and_padding():
    layout = ShardLayout(NUMELS, 4)
    assert layout.shard_numels == (2, 1, 1, 2, 2)
    assert layout.offsets == (0, 2, 3, 4, 6, 8)
    assert layout.owned_range(0, 2) == (4, 5) and layout.owned_range(0, 3) == (5, 5)
    assert layout.owned_range(2, 1) == (1, 1)


def test_pack_unpack_roundtrip_and_scale():
    layout = ShardLayout(NUMELS, 3)
    flats = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate(NUMELS)]
    packed = torch.full((3, layout.shard_numel), float("nan"))
    layout.pack(flats, 0, packed, scale=0.5)
    assert not torch.isnan(packed).any(), "padding must be zeroed"
    outs = [torch.empty(n) for n in NUMELS]
    layout.unpack(packed, 0, outs)
    for f, o in zip(flats, outs):
        torch.testing.assert_close(o, f * 0.5, rtol=0, atol=0)
    # a sub-range packs into its own span
    lo, hi = layout.span(1, 4)
    sub = torch.empty(3, hi - lo)
    layout.pack(flats[1:4], 1, sub)
    torch.testing.assert_close(sub, packed[:, lo:hi] * 2)
    # shard_of agrees with the packed row
    out = torch.empty(layout.shard_numels[3])
    layout.shard_of(flats[3], 3, 2, out)
    torch.testing.assert_close(out, packed[2, layout.offsets[3]:layout.offsets[4]] * 2)


def _reduce_scatter_then_gather():
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ShardLayout(NUMELS, world)
    flats = [torch.arange(n, dtype=torch.float32) * (rank + 1) for n in NUMELS]
    packed = torch.empty(world, layout.shard_numel)
    layout.pack(flats, 0, packed)
    shard = torch.empty(layout.shard_numel)
    reduce_scatter_packed(shard, packed)
    factor = sum(range(1, world + 1))
    gathered = torch.empty(world, layout.shard_numel)
    all_gather_packed(gathered, shard)
    outs = [torch.empty(n) for n in NUMELS]
    layout.unpack(gathered, 0, outs)
    for n, o in zip(NUMELS, outs):
        torch.testing.assert_close(o, torch.arange(n, dtype=torch.float32) * factor)
    return shard.tolist()


def test_packed_collectives_on_2_and_4_ranks():
    for world in (2, 4):
        shards = run_distributed(_reduce_scatter_then_gather, world)
        assert len(shards) == world
        assert all(len(s) == ShardLayout(NUMELS, world).shard_numel for s in shards)
