"""Where a ZeRO-3 shard lives is its storage: the same ShardedParam calls give the same values resident or swapped,
and only to_swapped / to_resident move them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hf_zero.config.policies import AioParams
from hf_zero.offload.param_swap import ParamSwapper, SwappedShard
from hf_zero.zero.stage3 import ShardedParam
from hf_zero.zero.stage3.storage import ResidentStorage, ShardStorage, ShardStore


def test_shard_moves_between_memory_and_swap_files_with_its_values_and_fp32_original(tmp_path):
    original = torch.randn(10, dtype=torch.float32)
    p = nn.Parameter(original.clone())
    sp = ShardedParam(p, "layer.weight", rank=1, world_size=2)  # elements 5..9
    sp.cast_shard(torch.bfloat16)
    assert isinstance(sp.storage, ResidentStorage) and isinstance(sp.storage, ShardStorage)
    resident_values = sp.shard_values().clone()

    swapper = ParamSwapper(tmp_path, rank=1, aio=AioParams())
    assert isinstance(swapper, ShardStore)
    sp.to_swapped(swapper)
    assert isinstance(sp.storage, SwappedShard) and isinstance(sp.storage, ShardStorage) and sp.swapped
    assert sp.local_shard.numel() == 0 and sp.local_shard.dtype == torch.bfloat16 and p.ds_tensor is sp.local_shard
    assert swapper.nbytes == 5 * 2 + 5 * 4  # the bf16 stream and the fp32 original
    assert torch.equal(sp.shard_values(), resident_values)
    assert torch.equal(sp.initial_fp32_shard(), original[5:])
    sp.to_swapped(swapper)  # swapped already: stays
    with pytest.raises(ValueError, match="layer.weight: the shard is in a swap file"):
        sp.use_shard_storage(torch.empty(5, dtype=torch.bfloat16))

    sp.store_shard(torch.tensor([1.0, 2.0]), lo=3)  # cast to the shard's dtype, wherever it lives
    expected = resident_values.clone()
    expected[3:5] = torch.tensor([1.0, 2.0])
    assert torch.equal(sp.shard_values(), expected)
    out = torch.empty(2, dtype=torch.bfloat16)
    sp.storage.read_async(out, 3).result()
    assert torch.equal(out, expected[3:])

    sp.to_resident()
    assert isinstance(sp.storage, ResidentStorage) and not sp.swapped and swapper.nbytes == 0
    assert torch.equal(sp.local_shard, expected) and p.ds_tensor is sp.local_shard
    assert torch.equal(sp.initial_fp32_shard(), original[5:])  # the fp32 original came back too
    sp.drop_initial_fp32_shard()
    assert torch.equal(sp.initial_fp32_shard(), expected.float())
    swapper.close()


def test_gathered_values_are_the_same_from_either_storage(tmp_path):
    from hf_zero.zero.stage3.gather import Gatherer

    values = torch.arange(14.0)
    resident = ShardedParam(nn.Parameter(values.clone()), "a", rank=0, world_size=1)
    swapped = ShardedParam(nn.Parameter(values.clone() * 2), "b", rank=0, world_size=1)
    swapper = ParamSwapper(tmp_path, rank=0, aio=AioParams())
    swapped.to_swapped(swapper)
    Gatherer(group=None).gather([resident, swapped], "test")
    assert torch.equal(resident.param.data, values) and torch.equal(swapped.param.data, values * 2)
    swapper.close()
