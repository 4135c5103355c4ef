"""hf_zero on a real GPU: every ZeRO stage trains the 160M Llama as a plain torch loop does, inside the ZeRO memory
formula, with everything the engine owns on the GPU; checkpoints written on the GPU resume there and load on a CPU.

Marked ``gpu``: skipped where CUDA is not available (CI). ``scripts/gpu_check.sh`` runs them on a GPU machine.

Tolerance: the engine keeps bf16 weights and fp32 masters, the reference fp32 weights under autocast; both round
the forward to bf16. Each step's loss must agree to within one bf16 unit at the loss's magnitude (2**-8 relative,
0.04 at a loss of 10.5) -- what "within bf16 noise" means here; DeepSpeed's own stages 0-2 land within 0.003 of the
same reference (../shared/gpu/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_zero.util.hf_compat import enable_activation_checkpointing

sys.path.insert(0, os.path.dirname(__file__))
import _gpu_llama as gl  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")]

BF16_REL = 2.0 ** -8
MODES = [(0, False), (1, False), (2, False), (3, False), (2, True)]


@pytest.fixture(scope="module")
def reference():
    return gl.torch_run()


def _check_placement(engine, offload: bool) -> dict:
    from hf_zero.zero.stage3.param import sharded_param_of

    dev = torch.device("cuda", torch.cuda.current_device())
    assert engine.device == dev
    where = {}
    for name, p in engine.module.named_parameters():
        sp = sharded_param_of(p)
        where[name] = (sp.storage.device if sp is not None else p.device).type
    for name, b in engine.module.named_buffers():
        where[name] = b.device.type
    off = [n for n, d in where.items() if d != "cuda"]
    assert not off, f"not on the GPU: {off[:5]}"
    for g in engine.groups:
        assert g.grad.device.type == "cuda" or g.grad.numel() == 0
        assert g.master.device.type == ("meta" if offload else "cuda")
        if g.param16 is not None:
            assert g.param16.device.type == "cuda"
    if offload:
        host = [t for h in engine.optimizer.offload._host for t in h.values()]
        assert host and all(t.device.type == "cpu" and t.is_pinned() for t in host)
    else:
        states = [t for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        assert states and all(t.device.type == "cuda" for t in states)
    if engine.stage == 3:
        shards = [sharded_param_of(p) for p in engine.module.parameters()]
        assert all(sp is not None for sp in shards)
    return {"params_on": sorted(set(where.values()))}


@pytest.mark.parametrize("stage,offload", MODES, ids=[f"z{s}{'_offload' if o else ''}" for s, o in MODES])
def test_stage_trains_like_torch_within_the_zero_formula(reference, stage, offload):
    seen = {}
    run = gl.hf_zero_run(stage, offload, inspect=lambda e: seen.update(_check_placement(e, offload)))
    assert seen["params_on"] == ["cuda"]
    for i, (mine, ref) in enumerate(zip(run.losses, reference.losses)):
        assert abs(mine - ref) <= BF16_REL * abs(ref), (i, run.losses, reference.losses)
    assert run.losses[-1] < run.losses[0] - 0.5, run.losses  # it learns (10.57 -> 9.67 for the reference)
    bound = gl.zero_formula_bytes(run, offload) + reference.activation_bytes
    assert run.max_alloc <= bound, (f"max allocated {run.max_alloc / 2**30:.2f} GiB > ZeRO formula "
                                    f"{gl.zero_formula_bytes(run, offload) / 2**30:.2f} GiB + activations "
                                    f"{reference.activation_bytes / 2**30:.2f} GiB")


def _small_engine(stage: int, **cfg_extra):
    import hf_zero

    cfg = gl.ds_config(stage)
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg.update(cfg_extra)
    model = gl._build(2)
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _steps(engine, n: int, offset: int = 0) -> list[float]:
    data = gl.batches(8)
    out = []
    for i in range(n):
        x = data[(offset + i) % 8][:2, :256]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


CPU_LOAD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
import _gpu_llama as gl, hf_zero
assert not torch.cuda.is_available()
cfg = gl.ds_config(int(sys.argv[4])); cfg["train_micro_batch_size_per_gpu"] = 2
model = gl._build(2)
engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
engine.load_checkpoint(sys.argv[1])
ref = torch.load(sys.argv[2])
with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
    diff = max((p.detach().float() - ref[n].float()).abs().max().item() for n, p in engine.module.named_parameters())
print(json.dumps({"device": str(engine.device), "max_abs_diff": diff, "steps": engine.global_steps}))
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_saved_on_gpu_resumes_on_gpu_and_loads_on_cpu(tmp_path, stage):
    import hf_zero

    engine = _small_engine(stage)
    _steps(engine, 3)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    after = _steps(engine, 3, offset=3)
    with hf_zero.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()

    resumed = _small_engine(stage)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.global_steps == 3
    again = _steps(resumed, 3, offset=3)
    # same kernels, same data: equal up to the GPU's nondeterministic reductions (attention backward)
    assert again == pytest.approx(after, abs=2e-3), (after, again)
    with hf_zero.zero.GatheredParameters(list(resumed.module.parameters())):
        saved = {n: p.detach().cpu().clone() for n, p in resumed.module.named_parameters()}
    resumed.destroy()
    worst = max((saved[n].float() - weights[n].float()).abs().max().item() for n in weights)
    assert worst <= 2e-2, worst  # a few bf16 units of the weights' scale at most

    # the checkpoint of step 3 on a machine without a GPU: weights equal those the GPU run had at step 3
    fresh = _small_engine(stage)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    with hf_zero.zero.GatheredParameters(list(fresh.module.parameters())):
        at3 = {n: p.detach().cpu().clone() for n, p in fresh.module.named_parameters()}
    fresh.destroy()
    torch.save(at3, tmp_path / "at3.pt")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + stage)}
    out = subprocess.run([sys.executable, "-c", CPU_LOAD, str(tmp_path / "ckpt"), str(tmp_path / "at3.pt"),
                          os.path.dirname(__file__), str(stage)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["steps"] == 3
    assert result["max_abs_diff"] == 0.0, result


def test_zero3_fp16_loss_scaling_gathered_parameters_and_generate():
    import hf_zero

    cfg = gl.ds_config(3)
    cfg.pop("bf16")
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 32}  # the first steps overflow: skipped, scale halves
    cfg["train_micro_batch_size_per_gpu"] = 2
    with hf_zero.zero.Init(config_dict_or_path=cfg):
        model = gl._build(2)
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = _steps(engine, 6)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert engine.skipped_steps >= 1 and engine.get_loss_scale() < 2.0 ** 32
    from hf_zero.zero.stage3.param import sharded_param_of

    w = engine.module.model.embed_tokens.weight
    # alone on one GPU every parameter stays whole, as a view of its shard (Stage3Runtime.whole): no copy
    assert engine.stage3.whole and w.shape == (gl.VOCAB, 1024)
    assert w.data_ptr() == sharded_param_of(w).local_shard.data_ptr()
    with hf_zero.zero.GatheredParameters([w]):
        assert w.shape == (gl.VOCAB, 1024) and w.device.type == "cuda" and w.dtype == torch.float16
    engine.module.eval()
    prompt = gl.batches(1)[0][:1, :8]
    with torch.no_grad():
        out = engine.module.generate(prompt, max_new_tokens=4, do_sample=False, synced_gpus=False)
    assert out.shape == (1, 12) and out.device.type == "cuda"
    engine.destroy()


def test_zero3_activation_checkpointing_matches_without():
    import hf_zero

    runs = []
    for ckpt in (False, True):
        cfg = gl.ds_config(3)
        cfg["train_micro_batch_size_per_gpu"] = 2
        with hf_zero.zero.Init(config_dict_or_path=cfg):
            model = gl._build(2)
        if ckpt:
            enable_activation_checkpointing(model, use_reentrant=False)
        engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.train()
        runs.append(_steps(engine, 4))
        engine.destroy()
    assert runs[1] == pytest.approx(runs[0], abs=1e-3), runs


def test_compiled_ops_run_on_the_gpu():
    """The install built hf_zero._C_cuda against this torch; the fused Adam and RMSNorm run there and match
    torch's own on CUDA tensors."""
    from hf_zero.ops import FusedAdam, rms_norm
    from hf_zero.ops._native import extension_status

    assert extension_status("cuda").loaded, extension_status("cuda").reason
    torch.manual_seed(0)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.rms_norm(x.float(), (1024,), w.float(), 1e-6)
    rel = ((rms_norm(x, w, 1e-6).float() - ref).abs() / (ref.abs() + 1e-2)).max().item()
    assert rel <= 2.0 ** -7, rel  # the bf16 result is the fp32 one rounded: within a bf16 unit (2**-8 relative)
    p = torch.nn.Parameter(torch.randn(4096, device="cuda"))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = q.grad = torch.randn(4096, device="cuda")
    FusedAdam([p], lr=1e-3).step()
    torch.optim.AdamW([q], lr=1e-3, weight_decay=0.0).step()
    assert (p - q).abs().max().item() < 1e-6


def _zero3_run(cfg: dict, steps: int = 4):
    """A 2-layer model built under zero.Init with ``cfg``; returns (losses, GPU bytes held between steps, where the
    shards live, the device of a gathered weight in forward)."""
    import hf_zero
    from hf_zero.zero.stage3.param import sharded_param_of

    gl._fresh()
    with hf_zero.zero.Init(config_dict_or_path=cfg):
        model = gl._build(2)
    engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    seen = []
    hook = engine.module.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda mod, args: seen.append(mod.weight.device.type))
    losses = _steps(engine, steps)
    hook.remove()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    sps = [sharded_param_of(p) for p in engine.module.parameters()]
    # where the shards live (alone on the GPU every parameter is whole and counts as persistent: all of them)
    homes = sorted({("swapped" if sp.swapped else sp.storage.device.type) for sp in sps
                    if engine.stage3.whole or not sp.persistent})
    pinned = all(g.param16.is_pinned() for g in engine.groups if g.param16 is not None and
                 g.param16.device.type == "cpu")
    assert engine.module.device.type == "cuda"  # what transformers moves inputs to
    engine.destroy()
    del engine, model
    gl._fresh()
    return losses, held, homes, seen[0], pinned


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_zero3_offload_param_to_host_and_nvme_trains_like_zero3(tmp_path, where):
    """ZeRO-Infinity's placement on a GPU: shards in pinned host memory or swap files, gathered to the GPU for each
    module, the optimizer stepping the host shards on the CPU. Same losses as ZeRO-3 on the GPU (the CPU Adam and
    the fused CUDA Adam agree to rounding), a fraction of its GPU memory held between steps."""
    cfg = gl.ds_config(3)
    cfg["train_micro_batch_size_per_gpu"] = 2
    base, base_held, base_homes, base_seen, _ = _zero3_run(cfg)
    assert base_homes == ["cuda"] and base_seen == "cuda"
    off = gl.ds_config(3)
    off["train_micro_batch_size_per_gpu"] = 2
    off["zero_optimization"]["offload_param"] = (
        {"device": "cpu", "pin_memory": True} if where == "cpu" else {"device": "nvme", "nvme_path": str(tmp_path)})
    losses, held, homes, seen, pinned = _zero3_run(off)
    assert homes == (["cpu"] if where == "cpu" else ["swapped"]) and seen == "cuda" and pinned
    for a, b in zip(losses, base):
        assert abs(a - b) <= BF16_REL * abs(b), (losses, base)
    # ZeRO-3 on the GPU holds 16 bytes per parameter between steps (2-layer model: 89M parameters, 1.4 GB)
    assert held <= 0.25 * base_held, (held, base_held)
