"""Checkpoints on node-local disks (``checkpoint.use_node_local_storage``), ranks agreeing on the loaded tag, and
bf16 master weights with fp32 or bf16 moments through a save and load.

Two "nodes" on one machine: 4 gloo ranks, ranks 0-1 on node 0 and 2-3 on node 1 by torchrun's ``GROUP_RANK`` (what
:func:`hf_zero.comm.get_node_id` reads); each node's ranks pass their own directory under the same name, so neither
node sees the other's files -- as two machines' local disks. One spawn runs every case in order.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_zero
from hf_zero.checkpoint.files import CheckpointError
from hf_zero.testing import run_distributed

from _parity import base_config, engine_run, make_model

LOCAL = {"checkpoint": {"use_node_local_storage": True}}


def _node_dir(base: Path, node: int, name: str) -> str:
    return str(base / f"node{node}" / name)


def _error(fn) -> str:
    with pytest.raises(CheckpointError) as info:
        fn()
    return str(info.value)


def _masters(engine) -> list[torch.Tensor]:
    return [g.master.detach().float().clone() for g in engine.groups]


def _resume(stage: int, save_dir: str, extra: dict, dtype=torch.float32) -> tuple[list, list]:
    """Train 2 steps, save to ``save_dir``, train 2 more; a fresh engine loads and trains the same 2 steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(stage, **extra))
    engine_run(engine, world, rank, steps=2, dtype=dtype)
    engine.save_checkpoint(save_dir, tag=f"s{stage}")
    uninterrupted = engine_run(engine, world, rank, steps=2, start=2, dtype=dtype)
    fresh, *_ = hf_zero.initialize(model=make_model(seed=7), config=base_config(stage, **extra))
    fresh.load_checkpoint(save_dir)
    return uninterrupted, engine_run(fresh, world, rank, steps=2, start=2, dtype=dtype)


def _two_nodes(base: str) -> dict:
    rank = dist.get_rank()
    node = rank // 2
    os.environ.update({"GROUP_RANK": str(node), "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2"})
    base = Path(base)
    mine = _node_dir(base, node, "ckpt")
    out: dict = {"node_id": hf_zero.comm.get_node_id()}

    # 1. node-local saves at stage 0 (unsharded optimizer state: one copy per node) and 3; exact resume
    out["resume"] = {stage: _resume(stage, mine, LOCAL) for stage in (0, 3)}

    # 2. the same key-less save into private directories: refused before anything is written, naming the key
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(3))
    engine_run(engine, 4, rank, steps=1)
    plain = _node_dir(base, node, "plain")
    out["not_shared"] = _error(lambda: engine.save_checkpoint(plain))
    dist.barrier()  # rank 0 removes its probe file on its way out of the error
    out["plain_listing"] = sorted(os.listdir(plain)) if os.path.isdir(plain) else None

    # 3. a different topology: each node gets the other node's directory -- refused, nothing changed
    local, *_ = hf_zero.initialize(model=make_model(), config=base_config(3, **LOCAL))
    before = _masters(local)
    swapped = _node_dir(base, 1 - node, "ckpt")
    out["swapped"] = _error(lambda: local.load_checkpoint(swapped, tag="s3"))
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _masters(local)))

    # 4. 'latest' differs between the nodes (node 1's still names the stage-0 tag): named, nothing loaded
    dist.barrier()
    if rank == 2:
        Path(mine, "latest").write_text("s0")
    dist.barrier()
    out["latest_differs"] = _error(lambda: local.load_checkpoint(mine))
    out["unchanged_after_latest"] = all(torch.equal(a, b) for a, b in zip(before, _masters(local)))

    # 5. bf16 master weights and gradients, with bf16 or fp32 moments, stages 2 and 3 (a shared directory)
    shared = str(base / "shared")
    out["bf16"] = {}
    for stage in (2, 3):
        for states in (True, False):
            bf16 = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                             "bf16_optimizer_states": states}}
            out["bf16"][(stage, states)] = _resume(stage, f"{shared}/{stage}{states}", bf16, torch.bfloat16)
    # fp32 moments saved, loaded by an engine configured for bf16 moments: they arrive in bf16
    eng, *_ = hf_zero.initialize(model=make_model(), config=base_config(2, bf16={
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}))
    eng.load_checkpoint(f"{shared}/2False")
    out["moment_dtype"] = str(eng.optimizer.state[eng.groups[0].master]["exp_avg"].dtype)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("nodes")
    return base, run_distributed(_two_nodes, 4, args=(str(base),), timeout_s=300)


def test_each_node_writes_its_own_complete_copy_and_resumes_exactly(runs):
    base, results = runs
    assert [r["node_id"].rsplit("#", 1)[1] for r in results] == ["0", "0", "1", "1"]
    for node, shards in ((0, ["zero_rank00000", "zero_rank00001"]), (1, ["zero_rank00002", "zero_rank00003"])):
        root = base / f"node{node}" / "ckpt"
        # no .tmp-, no probe left behind; each node's writer put the offline converter's script beside its tags
        assert sorted(os.listdir(root)) == ["latest", "s0", "s3", "zero_to_fp32.py"]
        assert (root / "latest").read_text() == ("s3" if node == 0 else "s0")  # node 1's was rewritten by case 4
        # stage 3: the node's writer's shared files, every rank's own shards
        assert sorted(os.listdir(root / "s3")) == ["engine_state.pt", "manifest.json", "meta.json",
                                                     *[f"{s}.safetensors" for s in shards]]
        # stage 0: the model file, and the unsharded optimizer state as zero_rank00000 on each node
        assert sorted(os.listdir(root / "s0")) == sorted(
            ["engine_state.pt", "manifest.json", "meta.json", "model.safetensors",
             *{f"{s}.safetensors" for s in ["zero_rank00000", *shards]}])
    for r in results:
        for stage, (uninterrupted, resumed) in r["resume"].items():
            assert resumed == pytest.approx(uninterrupted, rel=0, abs=1e-6), stage
            assert uninterrupted == results[0]["resume"][stage][0]


def test_private_directories_without_the_key_name_it(runs):
    base, results = runs
    msg = results[0]["not_shared"]
    assert "ranks [2, 3] (node " in msg and "#1'" in msg and "do not see the files rank 0" in msg
    assert '"use_node_local_storage": true' in msg and "Nothing was written" in msg
    for rank, r in enumerate(results):  # the same error on every rank (naming its own directory), not a hang
        own = str(base / f"node{rank // 2}" / "plain")
        assert r["not_shared"] == msg.replace(str(base / "node0" / "plain"), own)
    # rank 0 made the directory for its probe and removed the probe; node 1's was never made
    assert [r["plain_listing"] for r in results] == [[], [], None, None]


def test_files_of_another_node_are_refused_naming_file_rank_and_node(runs):
    base, results = runs
    for rank, r in enumerate(results):
        node = rank // 2
        msg = r["swapped"]
        assert f"rank {rank} (node " in msg and f"#{node}'" in msg, msg
        assert str(base / f"node{1 - node}" / "ckpt" / "s3" / f"zero_rank{rank:05d}.safetensors") in msg
        assert "which is not on this node" in msg and f"saved ranks {[2, 3] if node == 0 else [0, 1]} only" in msg
        assert r["unchanged"]


def test_ranks_whose_latest_differs_are_named(runs):
    base, results = runs
    msg = results[0]["latest_differs"]
    assert "the ranks would load different checkpoints" in msg
    assert "ranks [0, 1] (node " in msg and "read 's3'" in msg and "ranks [2, 3] (node " in msg and "read 's0'" in msg
    for rank, r in enumerate(results):
        own = str(base / f"node{rank // 2}" / "ckpt")
        assert r["latest_differs"] == msg.replace(str(base / "node0" / "ckpt"), own) and r["unchanged_after_latest"]


def test_bf16_master_weights_with_fp32_or_bf16_moments_resume_the_same_curve(runs):
    _, results = runs
    for r in results:
        for key, (uninterrupted, resumed) in r["bf16"].items():
            assert resumed == pytest.approx(uninterrupted, rel=0, abs=1e-6), key
    # fp32 and bf16 moments really differ (the case is not the same run twice)
    assert results[0]["bf16"][(2, True)][0] != results[0]["bf16"][(2, False)][0]
    assert results[0]["moment_dtype"] == "torch.bfloat16"
