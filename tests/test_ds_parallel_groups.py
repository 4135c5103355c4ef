"""``deepspeed.utils.groups``' data- and tensor-parallel getters (DeepSpeed's AutoTP guide: a script shards its own
data with ``groups.get_tensor_model_parallel_group()``), answered from the last initialized run's mesh; the engine's
``get_tensor_parallel_rank()`` / ``autotp_size()`` beside them. 2 ranks, in the shared TP spawn."""

from __future__ import annotations

import pytest

from _tp_spawns import case, register
from _tp_util import make_model


def _groups_worker():
    import torch.distributed as dist
    from deepspeed import utils as ds_utils
    from deepspeed.utils import groups

    import hf_zero
    from hf_zero.parallel.current import set_run_mesh

    rank = dist.get_rank()
    set_run_mesh(None)  # as before any initialize in this process (the shared spawn ran other cases first)
    out = {"before_underscore": (groups._get_data_parallel_world_size(), groups._get_model_parallel_world_size())}
    try:
        groups.get_tensor_model_parallel_group()
    except AssertionError as err:
        out["before"] = str(err)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 1000}
    engine, *_ = hf_zero.initialize(model=make_model("llama"), config={**config, "tensor_parallel": {"autotp_size": 2}})
    out["tp"] = (groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank(),
                 groups.get_tensor_model_parallel_src_rank(), groups.get_model_parallel_world_size(),
                 groups.get_data_parallel_world_size(), ds_utils.get_tensor_model_parallel_rank(),
                 engine.get_tensor_parallel_rank(), engine.autotp_size(), engine.get_data_parallel_rank())
    engine.destroy()
    engine, *_ = hf_zero.initialize(model=make_model("llama"), config=config)  # data parallel only: the latest run
    out["dp"] = (groups.get_tensor_model_parallel_world_size(), groups.get_data_parallel_world_size(),
                 groups.get_data_parallel_rank(), groups._get_data_parallel_world_size(), engine.autotp_size())
    engine.destroy()
    return rank, out


register(2, "ds_groups", _groups_worker)


@pytest.mark.parametrize("rank", [0, 1])
def test_groups_getters_answer_from_the_last_initialized_run(rank):
    got_rank, out = case(2, "ds_groups")[rank]
    assert got_rank == rank
    assert out["before_underscore"] == (2, 1)  # DeepSpeed's fallbacks: the whole world, model parallel 1
    assert out["before"].startswith("intra_layer_model parallel group is not initialized")
    # autotp_size 2 on 2 ranks: one TP pair, one data-parallel replica
    assert out["tp"] == (2, rank, 0, 2, 1, rank, rank, 2, 0)
    assert out["dp"] == (1, 2, rank, 2, 1)
