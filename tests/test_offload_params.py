"""ZeRO-3 parameter offload (``offload_param`` cpu and nvme) on 2 ranks matches the run without it.

One launch trains the parity MLP (stage 3, a frozen layer, persistent biases) with the shards in CPU memory,
in NVMe swap files, and in swap files together with the optimizer states on CPU or NVMe: losses and parameters
match the single-process reference (1e-5 relative, fp32) and are bitwise equal to the run without offload; the
swap files hold exactly this rank's shards (the bytes of every parameter that is not persistent) and are
gone after ``destroy``; the saved checkpoint is the same; checkpoints cross-load. A bf16 run checks the cast of
swapped shards (fp32 masters are built from the values before the cast). A tiny Llama built under
``zero.Init`` with the nvme config has its shards on disk from the start and trains like the resident one,
with the gathers served by read-ahead.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import hf_zero
from hf_zero.testing import run_distributed

from _parity import STEPS, base_config, clone_state, engine_run, make_model, reference_run

MODES = {
    "none": {},
    "param_cpu": {"offload_param": {"device": "cpu"}},
    "param_nvme": {"offload_param": {"device": "nvme", "nvme_path": "{root}/p"}},
    "param_nvme_opt_cpu": {"offload_param": {"device": "nvme", "nvme_path": "{root}/pc"},
                           "offload_optimizer": {"device": "cpu"}},
    "param_nvme_opt_nvme": {"offload_param": {"device": "nvme", "nvme_path": "{root}/pn"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "{root}/pn"}},
}


def _config(mode: str, root: str, **extra) -> dict:
    cfg = base_config(3, **extra)
    zero = cfg["zero_optimization"]
    zero["sub_group_size"] = 100  # several optimizer tiles per rank, each spanning parameter boundaries
    for key, section in MODES[mode].items():
        zero[key] = {k: (v.format(root=root) if isinstance(v, str) else v) for k, v in section.items()}
    cfg["aio"] = {"block_size": 256, "queue_depth": 2, "thread_count": 2}  # several requests per partition
    return cfg


def _swap_state(engine) -> dict:
    sw = engine.stage3.swapper
    if sw is None:
        return {}
    swapped = [sp for sp in engine.stage3.sharded_params() if sp.swapped]
    return {"nbytes": sw.nbytes, "files": sorted(os.listdir(sw.dir.path)), "path": str(sw.dir.path),
            "expected_nbytes": sum(sp.shard_numel * 4 for sp in swapped),
            "swapped": sorted(sp.name for sp in swapped),
            "resident_numel": sum(sp.local_shard.numel() for sp in swapped)}


def _mlp_modes(root: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for mode in MODES:
        engine, *_ = hf_zero.initialize(model=make_model(), config=_config(mode, root))
        swap = _swap_state(engine)
        losses = engine_run(engine, world, rank)
        engine.save_checkpoint(f"{root}/ckpt-{mode}")
        out[mode] = (losses, clone_state(engine), swap)
        engine.destroy()
        if swap:
            out[mode][2]["left_behind"] = os.path.exists(swap["path"])
    resumed = {}
    for mode, source in (("param_nvme_opt_nvme", "none"), ("none", "param_nvme_opt_nvme"),
                         ("param_nvme", "param_nvme_opt_cpu")):
        engine, *_ = hf_zero.initialize(model=make_model(seed=7), config=_config(mode, root))
        engine.load_checkpoint(f"{root}/ckpt-{source}")
        resumed[(mode, source)] = (engine_run(engine, world, rank, steps=3, start=STEPS - 3), clone_state(engine))
        engine.destroy()
    bf16 = {}
    for mode in ("none", "param_nvme_opt_nvme"):
        engine, *_ = hf_zero.initialize(model=make_model(), config=_config(mode, f"{root}/bf16",
                                                                             bf16={"enabled": True}))
        bf16[mode] = (engine_run(engine, world, rank, steps=4, dtype=torch.bfloat16), clone_state(engine))
        engine.destroy()
    return {"modes": out, "resumed": resumed, "bf16": bf16}


def _llama_config(root: str | None) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 3000,
            "reduce_bucket_size": 5000}
    if root is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": root}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": root}
        zero["sub_group_size"] = 2000
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
            "steps_per_print": 10**6}


def _llama(root: str | None) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_zero.zero import Init

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _llama_config(root)
    torch.manual_seed(0)
    with Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64))
    built = {}
    if root is not None:
        from hf_zero.offload.param_swap import param_swapper_for
        from hf_zero.offload.swapper import AioParams

        sw = param_swapper_for(root, rank=rank, aio=AioParams())
        params = list(model.parameters())
        built = {"swapped": sum(p._hf_zero_sharded.swapped for p in params), "params": len(params),
                 "resident": sum(p._hf_zero_sharded.local_shard.numel() for p in params),
                 "disk": sw.nbytes, "shards": sum(p._hf_zero_sharded.shard_numel * 4 for p in params)}
    engine, *_ = hf_zero.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, 97, (world, 2, 16), generator=g)[rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    sw = engine.stage3.swapper
    stats = {"ahead_hits": sw.ahead_hits, "read_numel": sw.read_numel} if sw is not None else {}
    state = clone_state(engine)
    engine.destroy()
    return {"losses": losses, "state": state, "built": built, "stats": stats}


def _all(root: str) -> dict:
    """Everything in one launch (spawning ranks costs more than the training)."""
    return {"mlp": _mlp_modes(f"{root}/mlp"), "llama_resident": _llama(None), "llama_nvme": _llama(f"{root}/llama")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload_param")
    return root, run_distributed(_all, 2, args=(str(root),), timeout_s=400)


def test_param_offload_parity(launched):
    root, launch = launched
    ref_losses, ref_params = reference_run(2)
    out = launch[0]["mlp"]["modes"]
    for mode, (losses, params, _) in out.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=lambda m: f"offload {mode} losses: {m}")
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"offload {mode} {name}: {m}")
            # offload changes where the shards live, not the arithmetic
            torch.testing.assert_close(params[name], out["none"][1][name], rtol=0, atol=0)


def test_swap_files_hold_the_partitions_and_are_removed(launched):
    _, launch = launched
    for r, rank_out in enumerate(launch):
        modes = rank_out["mlp"]["modes"]
        assert modes["none"][2] == {} and modes["param_cpu"][2] == {}
        for mode in ("param_nvme", "param_nvme_opt_cpu", "param_nvme_opt_nvme"):
            swap = modes[mode][2]
            # every weight matrix (frozen one included) is on disk; the biases (persistent) stay in memory
            assert swap["swapped"] == ["0.weight", "2.weight", "4.weight"], swap["swapped"]
            # 13x37, 37x29, 29x7 fp32 weights over 2 ranks: shards of 241, 537 and 102 elements
            assert swap["nbytes"] == swap["expected_nbytes"] == 4 * (241 + 537 + 102), swap
            assert swap["files"] == sorted(f"p{i}.swp" for i in _ids(swap["files"])) and len(swap["files"]) == 3
            assert swap["resident_numel"] == 0
            assert not swap["left_behind"], swap["path"]


def _ids(files: list[str]) -> list[int]:
    return [int(f[1:].split(".")[0]) for f in files]


def test_param_offload_checkpoints_are_identical_and_cross_load(launched):
    root, launch = launched
    tag = f"global_step{STEPS}"
    for r in range(2):
        base = load_file(str(root / "mlp" / "ckpt-none" / tag / f"zero_rank{r:05d}.safetensors"))
        assert any(k.startswith("stage3.frozen.") for k in base)
        for mode in list(MODES)[1:]:
            saved = load_file(str(root / "mlp" / f"ckpt-{mode}" / tag / f"zero_rank{r:05d}.safetensors"))
            assert sorted(saved) == sorted(base), mode
            for key in base:
                if not key.startswith("rng"):
                    torch.testing.assert_close(saved[key], base[key], rtol=0, atol=0,
                                               msg=lambda m: f"{mode} {key}: {m}")
    runs = list(launch[0]["mlp"]["resumed"].values())
    for losses, params in runs[1:]:
        assert losses == runs[0][0]
        for name in params:
            torch.testing.assert_close(params[name], runs[0][1][name], rtol=0, atol=0)


def test_bf16_swapped_partitions_keep_fp32_masters(launched):
    _, launch = launched
    bf16 = launch[0]["mlp"]["bf16"]
    assert bf16["param_nvme_opt_nvme"][0] == bf16["none"][0]
    for name, t in bf16["none"][1].items():
        torch.testing.assert_close(bf16["param_nvme_opt_nvme"][1][name], t, rtol=0, atol=0)


def test_zero_init_swaps_out_while_building_and_trains_the_same(launched):
    _, launch = launched
    for rank_out in launch:
        built = rank_out["llama_nvme"]["built"]
        # every shard went to disk as its module was built: nothing resident, files hold the shards
        assert built["swapped"] == built["params"] and built["resident"] == 0, built
        assert built["disk"] == built["shards"], built
    resident, nvme = launch[0]["llama_resident"], launch[0]["llama_nvme"]
    torch.testing.assert_close(torch.tensor(nvme["losses"]), torch.tensor(resident["losses"]), rtol=1e-5, atol=0)
    for name, t in resident["state"].items():
        torch.testing.assert_close(nvme["state"][name], t, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # after the first (recorded) iteration the gathers find their shards already read ahead
    assert nvme["stats"]["ahead_hits"] > 0, nvme["stats"]


def test_offload_param_errors_name_the_key(tmp_path):
    from hf_zero.config import load_config, zero_policy
    from hf_zero.offload import check_param_offload
    from hf_zero.offload.param_swap import ParamSwapper
    from hf_zero.offload.swapper import AioParams

    cfg = _config("param_nvme", str(tmp_path))
    zero = zero_policy(load_config(cfg, world_size=2))
    check_param_offload(zero, param_device=torch.device("cpu"))  # supported: nothing raised
    for mode in ("param_nvme", "param_cpu"):  # training on a GPU: accepted (tests/test_gpu_engine.py runs both)
        zero = zero_policy(load_config(_config(mode, str(tmp_path)), world_size=2))
        check_param_offload(zero, param_device=torch.device("cuda", 0))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=r"zero_optimization.offload_param.nvme_path=.*a_file.* is not a writable"):
        ParamSwapper(blocker, rank=0, aio=AioParams())


def _destroy_when_the_model_does_not_fit(root: str) -> dict:
    import hf_zero.zero.stage3.runtime as runtime

    cfg = _config("param_nvme", root)
    cfg["gradient_accumulation_steps"] = 1
    engine, *_ = hf_zero.initialize(model=make_model(), config=cfg)
    real = runtime._mem_available_bytes
    runtime._mem_available_bytes = lambda: 1000  # fewer bytes than the swapped weights (1757 fp32 weights: 7028 bytes)
    try:
        with pytest.raises(MemoryError, match=r"engine.destroy\) needs 7028 bytes .* 1000 bytes .*save_16bit_model"):
            engine.destroy()
    finally:
        runtime._mem_available_bytes = real
    # refused before anything changed: the engine still trains, then destroys normally
    x = torch.randn(2, 13)
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    engine.destroy()
    return {"loss": loss.item(), "weight_shape": tuple(engine.module[0].weight.shape)}


def test_destroy_refuses_to_materialize_a_model_larger_than_memory(tmp_path):
    out = run_distributed(_destroy_when_the_model_does_not_fit, 1, args=(str(tmp_path),), timeout_s=120)[0]
    assert out["weight_shape"] == (37, 13) and out["loss"] > 0
