"""One device mesh per run (#25): ``ParallelDims(dp, pp, tp)`` lays out the ranks, and every process group hf_zero's
engine uses -- ZeRO's data-parallel group, the tensor-parallel group, the pipeline's stage (p2p) and data groups,
the groups the gradient norm and the loss are summed over -- is a group of that one mesh, for data parallelism
(world 2), DP x TP (4 = 2 x 2), PP x DP (4 = 2 x 2), 3D (8 = 2 x 2 x 2) and runs given an ``mpu`` (world 2).

The distributed cases run in the shared per-world process groups of the tensor-parallel tests (tests/_tp_spawns.py);
each trains one step, so the groups are the ones actually used, and returns what it found as rank lists and
identity checks, asserted here.
"""

from __future__ import annotations

import dataclasses

import pytest

from _pipe_util import reference_run
from _tp_spawns import case, register

from hf_zero.config.errors import ConfigError
from hf_zero.parallel import ParallelDims


# ---- ParallelDims on its own ---------------------------------------------------------------------------------------
def test_dims_are_frozen_and_multiply_to_the_world():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert (dims.dp, dims.pp, dims.tp, dims.world_size) == (2, 2, 2, 8)
    assert ParallelDims.for_world(12, pp=2, tp=3) == ParallelDims(2, 2, 3)
    assert ParallelDims.for_world(4) == ParallelDims(4, 1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.tp = 4
    dims.check_world(8)  # no error


def test_product_other_than_the_world_is_refused_naming_keys_and_values():
    with pytest.raises(ConfigError) as err:
        ParallelDims(dp=2, pp=2, tp=3).check_world(8)
    msg = str(err.value)
    assert msg.startswith("tensor_parallel.autotp_size: ")
    assert "data-parallel size 2 x pipeline stages (num_stages) 2 x tensor_parallel.autotp_size 3 = 12 ranks" in msg
    assert "the world has 8" in msg

    with pytest.raises(ConfigError) as err:
        ParallelDims.for_world(8, pp=3)
    msg = str(err.value)
    assert msg.startswith("pipeline stages (num_stages): ") and "3 x tensor_parallel.autotp_size 1 = 3" in msg
    assert "does not divide the world size 8" in msg

    keys = ("the topology's 'data' axis", "the topology's 'pipe' axis (num_stages)", "wrap(tp_size)")
    with pytest.raises(ConfigError) as err:
        ParallelDims(1, 2, 2, keys=keys).check_world(8)
    assert str(err.value).startswith("wrap(tp_size): ")
    assert "the topology's 'pipe' axis (num_stages) 2" in str(err.value)


@pytest.mark.parametrize("sizes, key", [((0, 1, 1), "data-parallel size"), ((1, -2, 1), "pipeline stages"),
                                        ((1, 1, 1.5), "tensor_parallel.autotp_size"), ((True, 1, 1), "data-parallel")])
def test_sizes_must_be_positive_integers(sizes, key):
    with pytest.raises(ConfigError) as err:
        ParallelDims(*sizes)
    assert str(err.value).startswith(key) and "must be an integer >= 1" in str(err.value)


# ---- the groups of a run -------------------------------------------------------------------------------------------
def _ranks(group) -> list[int]:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _mesh_groups(mesh) -> dict[str, object]:
    """Every group of the mesh this rank is in: its dimensions and the flattened ones made from them."""
    groups = {dim: mesh.get_group(dim) for dim in mesh.mesh_dim_names}
    for name in mesh._get_root_mesh()._flatten_mapping:  # torch keeps flattened dimensions on the root mesh
        groups[name] = mesh.get_group(name)
    return groups


def _of_mesh(group, mesh) -> str | None:
    """The mesh dimension ``group`` is (by identity; None stands for the default group), or None."""
    import torch.distributed as dist

    group = dist.group.WORLD if group is None else group
    return next((dim for dim, g in _mesh_groups(mesh).items() if g is group), None)


def _engine_groups(engine) -> dict[str, object]:
    """Every group the engine hands to a collective, by use."""
    used = {"zero_dp": engine.process_group, "optimizer_dp": engine.optimizer.process_group}
    if engine.model_parallel_group is not None:
        used["norm_model_parallel"] = engine.model_parallel_group
        used["optimizer_model_parallel"] = engine.optimizer.model_parallel_group
    if engine.stage3 is not None:
        used["stage3"] = engine.stage3.group
    grid = getattr(engine, "grid", None)
    if grid is not None:  # the pipeline engine's: p2p and stage sums, data-parallel loss, grid's mpu answers
        used.update(pipe_p2p=grid.get_pipe_parallel_group(), pipe_dp=grid.get_data_parallel_group(),
                    pipe_model=grid.get_model_parallel_group(), pipe_slice=grid.get_slice_parallel_group(),
                    loss_dp=engine._dp_loss_group)
        for tg in engine.module.tied_groups:  # the copies of a tied weight sum their gradients over it
            if tg.group is not None:
                used[f"tied_{tg.key}"] = tg.group
    from hf_zero.tensor_parallel import tp_info

    info = tp_info(engine.module)
    if info is not None:
        used["tp_dtensor"] = info.group
    return used


def _report(engine) -> dict:
    """What a test asserts: the mesh's shape and this rank's group of each dimension, and which dimension each
    group the engine uses is (None: not a group of the mesh)."""
    mesh = engine.parallel_layout.mesh
    return {"shape": tuple(mesh.shape), "dims": tuple(mesh.mesh_dim_names),
            "mesh": {dim: _ranks(g) for dim, g in _mesh_groups(mesh).items()},
            "used": {use: (_of_mesh(g, mesh), _ranks(g)) for use, g in _engine_groups(engine).items()},
            "mp": (engine.mp_world_size, engine.checkpoint_mp_rank)}  # DeepSpeed's checkpoint names use the latter


def _train_step(engine) -> float:
    import torch

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "steps_per_print": 1000,
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000}, **extra}


def _dp_worker():
    import torch.distributed as dist

    import hf_zero
    from _tp_util import make_model

    out = {}
    for stage in (1, 3):
        cfg = _config(zero_optimization={"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000})
        engine, *_ = hf_zero.initialize(model=make_model("llama"), config=cfg)
        out[f"loss{stage}"] = _train_step(engine)
        out[f"zero{stage}"] = _report(engine)
        engine.destroy()
    try:  # dims whose product is not the world, built on a real world
        ParallelDims(dp=1).build_mesh()
    except ConfigError as e:
        out["wrong_world"] = str(e)
    try:
        hf_zero.initialize(model=make_model("llama"), config=_config(tensor_parallel={"autotp_size": 3}))
    except ValueError as e:
        out["tp_3"] = str(e)
    dist.barrier()
    return out


def _mpu_worker():
    import torch.distributed as dist

    import hf_zero
    from _tp_util import make_model
    from test_tp_mpu import ModelParallelUnit

    out = {}
    rank = dist.get_rank()
    # data parallel only: the mpu's data-parallel group is the whole world
    engine, *_ = hf_zero.initialize(model=make_model("llama"), config=_config(),
                                    mpu=ModelParallelUnit(dist.group.WORLD, dist.group.WORLD, 1))
    out["dp_loss"] = _train_step(engine)
    out["dp"] = _report(engine)
    out["dp_is_mpus"] = engine.parallel_layout.mesh.get_group("dp") is dist.group.WORLD
    engine.destroy()
    # tensor parallel over both ranks, a data-parallel group of one rank each (the AutoTP example's groups)
    tp_group = dist.new_group([0, 1])
    dp_groups = [dist.new_group([0]), dist.new_group([1])]
    engine, *_ = hf_zero.initialize(model=make_model("llama"), config=_config(tensor_parallel={"autotp_size": 2}),
                                    mpu=ModelParallelUnit(tp_group, dp_groups[rank], 2))
    out["tp_loss"] = _train_step(engine)
    out["tp"] = _report(engine)
    mesh = engine.parallel_layout.mesh
    out["tp_is_mpus"] = (mesh.get_group("tp") is tp_group, mesh.get_group("dp") is dp_groups[rank])
    engine.destroy()
    # a model sharded with apply_tp over a bare 1-D mesh of the world: its group becomes the mesh's tp dimension
    from torch.distributed.device_mesh import init_device_mesh

    from hf_zero.tensor_parallel import apply_tp

    line = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = apply_tp(make_model("llama"), line)
    engine, *_ = hf_zero.initialize(model=model, config=_config(tensor_parallel={"autotp_size": 2}))
    out["line_loss"] = _train_step(engine)
    out["line"] = _report(engine)
    out["line_is_users"] = engine.parallel_layout.mesh.get_group("tp") is line.get_group()
    engine.destroy()
    dist.barrier()
    return out


def _dp_tp_worker():
    import torch.distributed as dist

    import hf_zero
    from _tp_util import make_model
    from hf_zero.tensor_parallel import tp_info

    engine, *_ = hf_zero.initialize(model=make_model("llama"), config=_config(tensor_parallel={"autotp_size": 2}))
    out = {"loss": _train_step(engine), "report": _report(engine)}
    out["same_mesh"] = tp_info(engine.module).layout.mesh is engine.parallel_layout.mesh
    engine.destroy()
    # sharded before initialize (tp_model_init): the mesh it was sharded on is the run's
    model = hf_zero.tensor_parallel.tp_model_init(make_model("llama"), tp_size=2)
    engine, *_ = hf_zero.initialize(model=model, config=_config(tensor_parallel={"autotp_size": 2}))
    out["pre_loss"] = _train_step(engine)
    out["pre"] = _report(engine)
    out["pre_same_mesh"] = tp_info(model).layout.mesh is engine.parallel_layout.mesh
    engine.destroy()
    dist.barrier()
    return out


def _pp_dp_worker():
    import torch
    import torch.distributed as dist

    import hf_zero
    from _pipe_util import data, ds_config, layer_list
    from hf_zero.pipe import PipelineModule

    model = PipelineModule(layer_list(tied=True), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                           seed_layers=True)
    # the config's activation checkpointing is step 3 of runtime/parallelize.py's order, before ZeRO
    engine, *_ = hf_zero.initialize(model=model, config=ds_config(2, activation_checkpoint_interval=2))
    x, y = data(1, 2, engine.grid.data_parallel_size)
    d = engine.grid.data_parallel_id
    loss = engine.train_batch(iter([(x[0, j, d], y[0, j, d]) for j in range(2)]))
    out = {"loss": loss.item(), "report": _report(engine), "same_mesh": engine.grid.device_mesh is
           engine.parallel_layout.mesh, "engine": type(engine).__name__,
           "checkpoint_interval": model.activation_checkpoint_interval}
    engine.destroy()
    dist.barrier()
    return out


def _3d_worker():
    import torch
    import torch.distributed as dist

    import hf_zero
    from _tp_util import make_model
    from hf_zero.pipeline import wrap
    from hf_zero.tensor_parallel import tp_info

    pipe = wrap(make_model("llama"), num_stages=2, tp_size=2)
    cfg = _config(tensor_parallel={"autotp_size": 2}, pipeline={"schedule": "1f1b"}, gradient_accumulation_steps=2)
    engine, *_ = hf_zero.initialize(model=pipe, config=cfg)
    torch.manual_seed(engine.grid.data_parallel_id)
    ids = torch.randint(0, 128, (2, 2, 16))
    loss = engine.train_batch(iter([{"input_ids": ids[j], "labels": ids[j]} for j in range(2)]))
    out = {"loss": loss.item(), "report": _report(engine),
           "same_mesh": (engine.grid.device_mesh is engine.parallel_layout.mesh,
                         tp_info(pipe).layout.mesh is engine.parallel_layout.mesh)}
    engine.destroy()
    dist.barrier()
    return out


register(2, "parallel_dims_dp", _dp_worker)
register(2, "parallel_dims_mpu", _mpu_worker)
register(4, "parallel_dims_dp_tp", _dp_tp_worker)
register(4, "parallel_dims_pp_dp", _pp_dp_worker)
register(8, "parallel_dims_3d", _3d_worker)


def _check_all_of_mesh(report: dict, rank: int):
    stray = {use: ranks for use, (dim, ranks) in report["used"].items() if dim is None}
    assert not stray, (rank, "groups not of the run's mesh", stray, report["mesh"])
    assert report["dims"] == ("pp", "dp", "tp"), report["dims"]


def test_data_parallel_groups_are_the_meshs():
    for rank, out in enumerate(case(2, "parallel_dims_dp")):
        for stage in (1, 3):
            report = out[f"zero{stage}"]
            _check_all_of_mesh(report, rank)
            assert report["shape"] == (1, 2, 1)
            assert report["mesh"] == {"pp": [rank], "dp": [0, 1], "tp": [rank]}
            assert report["mp"] == (1, 0)
            assert report["used"]["zero_dp"] == ("dp", [0, 1]) and report["used"]["optimizer_dp"] == ("dp", [0, 1])
            assert 4.0 < out[f"loss{stage}"] < 6.0  # ln(128) = 4.85: an untrained model's cross entropy
        assert report["used"]["stage3"] == ("dp", [0, 1])
        assert out["wrong_world"].startswith("data-parallel size: data-parallel size 1 x pipeline stages")
        assert "= 1 ranks, but the world has 2" in out["wrong_world"]
        assert "tensor_parallel.autotp_size=3 must be >= 1 and divide the world size 2" in out["tp_3"]


def test_mpu_groups_are_the_meshs_and_the_mpus_own():
    for rank, out in enumerate(case(2, "parallel_dims_mpu")):
        _check_all_of_mesh(out["dp"], rank)
        assert out["dp"]["shape"] == (1, 2, 1) and out["dp"]["used"]["zero_dp"] == ("dp", [0, 1])
        assert out["dp_is_mpus"] is True
        _check_all_of_mesh(out["tp"], rank)
        assert out["tp"]["shape"] == (1, 1, 2)
        assert out["tp"]["used"]["zero_dp"] == ("dp", [rank]) and out["tp"]["used"]["tp_dtensor"] == ("tp", [0, 1])
        assert out["tp"]["used"]["norm_model_parallel"] == ("tp", [0, 1])
        assert out["tp_is_mpus"] == (True, True)
        assert 4.0 < out["dp_loss"] < 6.0 and 4.0 < out["tp_loss"] < 6.0
        _check_all_of_mesh(out["line"], rank)
        assert out["line"]["shape"] == (1, 1, 2) and out["line_is_users"] is True
        assert out["line"]["used"]["zero_dp"] == ("dp", [rank]) and out["line"]["used"]["tp_dtensor"] == ("tp", [0, 1])
        assert 4.0 < out["line_loss"] < 6.0


def test_dp_by_tp_groups_are_the_meshs():
    for rank, out in enumerate(case(4, "parallel_dims_dp_tp")):
        for key in ("report", "pre"):
            report = out[key]
            _check_all_of_mesh(report, rank)
            assert report["shape"] == (1, 2, 2)
            # tp innermost: {0,1} {2,3}; dp across: {0,2} {1,3}
            assert report["mesh"] == {"pp": [rank], "dp": [rank % 2, rank % 2 + 2],
                                      "tp": [rank // 2 * 2, rank // 2 * 2 + 1]}, (rank, report["mesh"])
            assert report["used"]["zero_dp"] == ("dp", [rank % 2, rank % 2 + 2])
            assert report["used"]["tp_dtensor"][0] == report["used"]["norm_model_parallel"][0] == "tp"
            assert report["mp"] == (2, rank % 2)  # the tensor-parallel rank, as DeepSpeed's mp_rank_XX
        assert out["same_mesh"] is True and out["pre_same_mesh"] is True
        assert 4.0 < out["loss"] < 6.0 and 4.0 < out["pre_loss"] < 6.0


def test_pipeline_by_dp_groups_are_the_meshs():
    for rank, out in enumerate(case(4, "parallel_dims_pp_dp")):
        report = out["report"]
        _check_all_of_mesh(report, rank)
        assert out["engine"] == "PipelineEngine" and out["same_mesh"] is True
        assert report["shape"] == (2, 2, 1)
        # stages {0,1} and {2,3}: the data-parallel pair shares a stage, the pipeline pair a replica
        assert report["mesh"]["pp"] == [rank % 2, rank % 2 + 2] and report["mesh"]["dp"] == [rank // 2 * 2,
                                                                                            rank // 2 * 2 + 1]
        used = report["used"]
        assert used["pipe_p2p"][0] == "pp" and used["pipe_model"][0] == "pp"  # model parallel = the stages here
        assert used["zero_dp"][0] == used["pipe_dp"][0] == used["loss_dp"][0] == "dp"
        assert used["pipe_slice"] == ("tp", [rank])
        assert used["tied_emb"] == used["pipe_p2p"]  # both stages hold a copy: the copies' group is the pp group
        assert out["checkpoint_interval"] == 2
        # the one-process reference's first loss: the layout changes where the work runs, not what it computes
        assert out["loss"] == pytest.approx(reference_run(tied=True, steps=1, micro_batches=2, dp=2)[0][0], rel=1e-5)


def test_3d_groups_are_the_meshs():
    for rank, out in enumerate(case(8, "parallel_dims_3d")):
        report = out["report"]
        _check_all_of_mesh(report, rank)
        assert report["shape"] == (2, 2, 2) and out["same_mesh"] == (True, True)
        pp, dp, tp = rank // 4, rank // 2 % 2, rank % 2
        assert report["mesh"]["tp"] == [rank - tp, rank - tp + 1]
        assert report["mesh"]["dp"] == [pp * 4 + tp, pp * 4 + 2 + tp]
        assert report["mesh"]["pp"] == [dp * 2 + tp, dp * 2 + tp + 4]
        used = report["used"]
        # the gradient norm's model-parallel group: the pipe x tensor ranks of this replica, flattened from the mesh
        assert used["pipe_model"] == ("pp_tp", sorted([dp * 2, dp * 2 + 1, dp * 2 + 4, dp * 2 + 5]))
        assert used["norm_model_parallel"] == used["pipe_model"]
        assert used["tp_dtensor"][0] == used["pipe_slice"][0] == "tp"
        assert used["pipe_p2p"][0] == "pp" and used["zero_dp"][0] == used["loss_dp"][0] == "dp"
        assert 4.0 < out["loss"] < 6.0
