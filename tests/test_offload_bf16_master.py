"""``bf16.bf16_master_weights_and_grads`` with ``offload_optimizer: cpu`` -- DeepSpeed 0.19.8's own way to run bf16
master weights (it requires ZeRO-Offload for them unless ``bf16_optimizer_states`` keeps the moments in bf16 on the
device). The offloaded CPU Adam steps the bf16 masters (the weights themselves) in fp32 and rounds once, with fp32
moments, or bf16 ones with ``bf16_optimizer_states``.

On 2 ranks at stages 2 and 3 the offloaded run trains exactly as the same config without the offload (the same
kernel on the same values), holds 10 (6 with bf16 moments) bytes of state per shard element in host memory instead
of 12, and a checkpoint saved after step 3 resumes to the uninterrupted run's losses and weights, bit for bit.
With every ZeRO-3 shard in swap files (``offload_param: nvme``) the masters are bf16 too, and train the same.
"""

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.testing import run_distributed

from _parity import base_config, engine_run, make_model

BF16_MASTER = {"enabled": True, "bf16_master_weights_and_grads": True}


def _config(stage: int, offload: bool, states16: bool) -> dict:
    cfg = base_config(stage, bf16={**BF16_MASTER, "bf16_optimizer_states": states16})
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def _weights(engine) -> list[torch.Tensor]:
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def _runs(root: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage in (2, 3):
        for states16 in (False, True):
            case = {}
            for offload in (False, True):
                engine, *_ = hf_zero.initialize(model=make_model(), config=_config(stage, offload, states16))
                losses = engine_run(engine, world, rank, steps=5, dtype=torch.bfloat16)
                case["offload" if offload else "device"] = (losses, _weights(engine))
                if offload:
                    off = engine.optimizer.offload
                    case["dtypes"] = {s: t.dtype for s, t in off.state_tensors(0).items()}
                    case["bytes"] = (off.resident_state_nbytes(), sum(g.shard_numel for g in engine.groups))
                engine.destroy()
            # resume: 3 steps, save, a fresh engine loads and trains steps 3-4
            path = f"{root}/s{stage}_{int(states16)}"
            engine, *_ = hf_zero.initialize(model=make_model(), config=_config(stage, True, states16))
            engine_run(engine, world, rank, steps=3, dtype=torch.bfloat16)
            engine.save_checkpoint(path, tag="t")
            engine.destroy()
            engine, *_ = hf_zero.initialize(model=make_model(seed=7), config=_config(stage, True, states16))
            engine.load_checkpoint(path, tag="t")
            case["resumed"] = (engine_run(engine, world, rank, steps=2, dtype=torch.bfloat16, start=3),
                               _weights(engine))
            engine.destroy()
            out[(stage, states16)] = case
    return out


def _swapped_runs(root: str) -> dict:
    """Stage 3 with every shard in swap files (offload_param nvme), the optimizer states on the device or offloaded:
    the bf16 master is built from the shards' fp32 starting values (read from their files) rounded once."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name, offload in (("device", False), ("swapped", False), ("swapped_offload", True)):
        cfg = _config(3, offload, False)
        if name != "device":
            cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": f"{root}/{name}"}
        engine, *_ = hf_zero.initialize(model=make_model(), config=cfg)
        out[name] = (engine_run(engine, world, rank, steps=4, dtype=torch.bfloat16), _weights(engine),
                     {g.master.dtype for g in engine.groups})
        engine.destroy()
    return out


def test_bf16_masters_with_shards_in_swap_files(tmp_path):
    for r in run_distributed(_swapped_runs, 2, args=(str(tmp_path),)):
        losses, weights, _ = r["device"]
        for name in ("swapped", "swapped_offload"):
            assert r[name][0] == losses, name
            assert all(torch.equal(a, b) for a, b in zip(r[name][1], weights)), name
        assert r["swapped"][2] == {torch.bfloat16}  # it was fp32 before: the key silently did nothing there


def test_offloaded_bf16_masters_train_as_on_the_device_and_resume(tmp_path):
    for r in run_distributed(_runs, 2, args=(str(tmp_path),)):
        for (stage, states16), case in r.items():
            what = f"stage {stage}, bf16 states {states16}"
            (dev_losses, dev_w), (off_losses, off_w) = case["device"], case["offload"]
            assert off_losses == dev_losses, what
            for a, b in zip(off_w, dev_w):
                assert a.dtype == torch.bfloat16 and torch.equal(a, b), what
            moments = torch.bfloat16 if states16 else torch.float32
            assert case["dtypes"] == {"master": torch.bfloat16, "exp_avg": moments, "exp_avg_sq": moments}, what
            held, n = case["bytes"]
            assert held == (6 if states16 else 10) * n, (what, held, n)
            resumed_losses, resumed_w = case["resumed"]
            assert resumed_losses == off_losses[3:], what
            for a, b in zip(resumed_w, off_w):
                assert torch.equal(a, b), what
