"""``deepspeed.comm``'s functional API as training scripts call it (DeepSpeed's names and keyword arguments), on 2
gloo ranks: every collective is checked by the values each rank ends up with, the comms-logger calls by what they
record (tests/test_comms_logger.py checks the logger in depth), the accelerator's DeepSpeed answers by value."""

from __future__ import annotations

import pytest
import torch

from hf_zero.integrations.deepspeed_shim._finder import install
from hf_zero.testing import run_distributed

install()  # as the start-up .pth line does in an installed hf_zero


def _collectives():
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"rank_world_local": (rank, world, dist.get_local_rank())}

    gathered = torch.zeros(world)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)]))
    out["all_gather_into_tensor"] = gathered.tolist()
    gathered = torch.zeros(world)
    dist.allgather_fn(gathered, torch.tensor([float(rank + 5)]))
    out["allgather_fn"] = gathered.tolist()

    scattered = torch.zeros(1)
    dist.reduce_scatter_tensor(scattered, torch.arange(world, dtype=torch.float32) + 10 * rank)
    out["reduce_scatter_tensor"] = scattered.tolist()  # rank r: sum over ranks of (r + 10*q)
    scattered = torch.zeros(1)
    dist.reduce_scatter_fn(scattered, torch.ones(world) * (rank + 1), op=dist.ReduceOp.MAX)
    out["reduce_scatter_fn_max"] = scattered.tolist()

    reduced = torch.tensor([float(rank + 1)])
    dist.reduce(reduced, dst=0)
    out["reduce"] = reduced.item()  # rank 0: the sum; others: unspecified by torch, not compared
    summed = torch.tensor([float(rank + 1)])
    dist.inference_all_reduce(summed)
    out["inference_all_reduce"] = summed.item()

    exchanged = torch.zeros(world)
    dist.all_to_all_single(exchanged, torch.arange(world, dtype=torch.float32) + 10 * rank)
    out["all_to_all_single"] = exchanged.tolist()
    uneven = torch.zeros(3)  # rank 0 sends 1 element to 0 and 2 to 1; rank 1 sends 2 to 0 and 1 to 1
    splits_in = [1, 2] if rank == 0 else [2, 1]
    splits_out = [1, 2] if rank == 0 else [2, 1]
    dist.all_to_all_single(uneven, torch.arange(3, dtype=torch.float32) + 100 * rank,
                           output_split_sizes=splits_out, input_split_sizes=splits_in)
    out["all_to_all_single_uneven"] = uneven.tolist()

    objects = [{"from": rank}, rank * 7]
    dist.broadcast_object_list(objects, src=1)
    out["broadcast_object_list"] = objects
    everyone = [None] * world
    dist.all_gather_object(everyone, {"r": rank})
    out["all_gather_object"] = everyone

    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
        req = dist.irecv(back := torch.zeros(2), src=1)
        req.wait()
        out["p2p"] = back.tolist()
    else:
        got = torch.zeros(1)
        dist.recv(got, src=0)
        dist.isend(got.repeat(2) + 1, dst=0).wait()
        out["p2p"] = got.tolist()

    group = dist.new_group(ranks=list(range(world)))
    in_group = torch.tensor([float(rank)])
    dist.all_reduce(in_group, group=group)
    out["new_group_all_reduce"] = in_group.item()
    out["get_world_group_is_world"] = dist.get_world_group() is torch.distributed.group.WORLD
    out["get_global_rank"] = [dist.get_global_rank(group, r) for r in range(world)] + [dist.get_global_rank(None, 1)]
    out["get_all_ranks_from_group"] = dist.get_all_ranks_from_group(group)

    # everything above ran with the comms logger off: nothing was recorded
    out["comm_log_empty"] = (dist.has_comm_data(), dist.get_comm_operation_count(), dist.get_logged_comm_ops())
    dist.configure(enabled=True, prof_all=False)
    dist.all_reduce(torch.zeros(1))  # neither prof_all, nor in prof_ops, nor prof=True
    dist.reduce(torch.zeros(2), dst=0, prof=True)
    summary = dist.log_summary(return_dict=True)["summary"]
    out["comms_logger"] = {op: {size: row["count"] for size, row in rows.items()} for op, rows in summary.items()}
    dist.configure(enabled=False)
    dist.reset_log()
    mesh = dist.initialize_mesh_device((world, 1), ("data_parallel", "sequence_parallel"))
    out["mesh"] = (mesh.device_type, tuple(mesh.shape), mesh.mesh_dim_names, mesh.get_local_rank("data_parallel"))
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_collectives, world_size=2)


def test_deepspeed_comm_collectives_on_two_ranks(two_ranks):
    r0, r1 = two_ranks
    assert r0["rank_world_local"] == (0, 2, 0) and r1["rank_world_local"][:2] == (1, 2)
    for r in (r0, r1):
        assert r["all_gather_into_tensor"] == [0.0, 1.0]
        assert r["allgather_fn"] == [5.0, 6.0]
        assert r["inference_all_reduce"] == 3.0
        assert r["broadcast_object_list"] == [{"from": 1}, 7]
        assert r["all_gather_object"] == [{"r": 0}, {"r": 1}]
        assert r["new_group_all_reduce"] == 1.0
        assert r["get_world_group_is_world"] is True
        assert r["get_global_rank"] == [0, 1, 1]
        assert r["get_all_ranks_from_group"] == [0, 1]
        assert r["reduce_scatter_fn_max"] == [2.0]
        assert r["comm_log_empty"] == (False, 0, [])
    assert r0["reduce_scatter_tensor"] == [0.0 + 10.0] and r1["reduce_scatter_tensor"] == [2.0 + 10.0]
    assert r0["reduce"] == 3.0
    assert r0["all_to_all_single"] == [0.0, 10.0] and r1["all_to_all_single"] == [1.0, 11.0]
    # rank 0 gets its own element 0 and rank 1's first two (100, 101); rank 1 gets rank 0's 1, 2 and its own 102
    assert r0["all_to_all_single_uneven"] == [0.0, 100.0, 101.0]
    assert r1["all_to_all_single_uneven"] == [1.0, 2.0, 102.0]
    assert r1["p2p"] == [42.0] and r0["p2p"] == [43.0, 43.0]
    for rank, r in enumerate((r0, r1)):  # DeepSpeed's initialize_mesh_device: torch's DeviceMesh, here on the CPU
        assert r["mesh"] == ("cpu", (2, 1), ("data_parallel", "sequence_parallel"), rank)


def test_comms_logger_records_what_is_asked_for(two_ranks):
    for r in two_ranks:
        assert r["comms_logger"] == {"reduce": {8: 1}}  # the prof=True reduce of 2 floats, not the all_reduce


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU accelerator's answers")
def test_accelerator_answers_as_deepspeeds_cpu_accelerator():
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc.default_generator(0) is torch.default_generator and acc.default_generator(3) is torch.default_generator
    assert acc.lazy_call(lambda: 41 + 1) == 42  # called now, its result returned
    assert acc.manual_seed(5) is torch.default_generator and acc.manual_seed_all(5) is torch.default_generator
    assert torch.initial_seed() == 5
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    made = {name: getattr(acc, name)([1, 2]) for name in (
        "FloatTensor", "BFloat16Tensor", "HalfTensor", "DoubleTensor", "IntTensor", "LongTensor", "ByteTensor")}
    assert {name: t.dtype for name, t in made.items()} == {
        "FloatTensor": torch.float32, "BFloat16Tensor": torch.bfloat16, "HalfTensor": torch.float16,
        "DoubleTensor": torch.float64, "IntTensor": torch.int32, "LongTensor": torch.int64, "ByteTensor": torch.uint8}
    assert all(t.tolist() == [1, 2] and t.device.type == "cpu" for t in made.values())

    import deepspeed.ops.op_builder as builders

    assert acc.get_op_builder("CPUAdamBuilder") is builders.CPUAdamBuilder
    assert acc.get_op_builder("FusedAdamBuilder") is builders.FusedAdamBuilder
    assert acc.get_op_builder("AsyncIOBuilder") is builders.AsyncIOBuilder
    assert acc.get_op_builder("NoSuchBuilder") is builders.NotImplementedBuilder
    builder = acc.create_op_builder("CPUAdamBuilder")
    assert isinstance(builder, builders.CPUAdamBuilder) and builder.is_compatible()
    with pytest.raises(ValueError, match="NotImplementedBuilder"):
        acc.create_op_builder("NoSuchBuilder").load()
    # DeepSpeed's other builder names import (DeepSpeed's own test files import FusedLambBuilder at module level);
    # hf_zero builds none of those ops, so they answer as DeepSpeed's NotImplementedBuilder for their op
    import deepspeed.ops
    from deepspeed.ops.op_builder import FusedLambBuilder, TransformerBuilder

    assert acc.get_op_builder("FusedLambBuilder") is FusedLambBuilder
    assert issubclass(FusedLambBuilder, builders.NotImplementedBuilder) and not FusedLambBuilder().is_compatible()
    assert (FusedLambBuilder().name, TransformerBuilder().name) == ("fused_lamb", "transformer")
    assert deepspeed.ops.__compatible_ops__["fused_lamb"] is False and deepspeed.ops.__compatible_ops__["cpu_adam"]
    with pytest.raises(ValueError, match="no op 'fused_lamb'"):
        FusedLambBuilder().load()


def _ds_barrier_signature():
    import deepspeed.comm as dist

    assert dist.barrier() is None
    work = dist.barrier(async_op=True, prof=True, log_name="my_barrier")
    work.wait()
    return dist.get_rank()


def test_barrier_takes_deepspeeds_arguments():
    """``deepspeed.comm.barrier(group, async_op, device_ids, prof, log_name, debug)`` as DeepSpeed defines it."""
    from hf_zero.testing import run_distributed

    assert run_distributed(_ds_barrier_signature, 2) == [0, 1]
