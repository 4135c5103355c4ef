"""zero.Init with bf16 / fp16 in the config builds the model in that dtype, as DeepSpeed 0.19.8 does (issue #26 item
11; transformers' ``test_init_zero3_bf16`` / ``test_init_zero3_fp16`` read ``model.dtype`` after ``from_pretrained``).

DeepSpeed's run (2 CPU ranks, gloo, ``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu``), ``nn.Sequential(Linear(8,
16), BatchNorm1d(16), Linear(16, 4))`` under ``deepspeed.zero.Init(config_dict_or_path=cfg)``:

    bf16.enabled   param.dtype bfloat16, param.ds_tensor.dtype bfloat16, under GatheredParameters bfloat16 (16, 8);
                   running_mean/var bfloat16; values == the fp32 initialisation rounded to bfloat16
    fp16.enabled   the same in float16
    neither        float32 throughout
    no config      float16 (DeepSpeed's default dtype when the accelerator reports fp16 support, the CPU included)
    after initialize (bf16, stage 3): fp32 master partition == the bf16 partition upcast (torch.equal: masters start
                   from the 16-bit values, _create_fp32_partitions); buffers stay bfloat16
    tiny LlamaForCausalLM: parameters and rotary_emb.inv_freq / original_inv_freq bfloat16

hf_zero now shows the same dtypes (without a config it keeps the build dtype; see hf_zero/zero/init.py) and keeps no
fp32 copy of the shards (docs/zero_memory.md says why). Training from such a model tracks the fp32 reference within the
bounds of the bf16/fp16 engine tests (tests/test_engine_precision.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.testing import run_distributed

from _parity import base_config, clone_state, engine_run, full_optimizer_state, make_model, reference_run

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _precision_config(precision: str) -> dict:
    extra = {precision: {"enabled": True}}
    if precision == "fp16":
        extra["fp16"].update({"initial_scale_power": 8, "hysteresis": 1})
    return base_config(3, **extra)


def _dtypes(model: nn.Module) -> dict:
    from hf_zero.zero import GatheredParameters

    w = model[0].weight
    with GatheredParameters([w]):
        gathered = (w.dtype, tuple(w.shape))
    params = list(model.parameters())
    return {"param": {p.dtype for p in params}, "ds_tensor": {p.ds_tensor.dtype for p in params}, "gathered": gathered}


def _run(tmp_dir: str) -> dict:
    from hf_zero.zero import GatheredParameters, Init

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for precision, dtype in DTYPES.items():
        cfg = _precision_config(precision)
        with Init(config_dict_or_path=cfg):
            model = make_model()
            norm = nn.BatchNorm1d(4)
        r = _dtypes(model)
        r["buffers"] = {n: b.dtype for n, b in norm.named_buffers()}
        with GatheredParameters(list(model.parameters())):  # the fp32 initialisation, rounded once
            r["values_are_rounded_init"] = all(torch.equal(p, q.detach().to(dtype)) for p, q in
                                               zip(model.parameters(), make_model().parameters()))
        engine, *_ = hf_zero.initialize(model=model, config=cfg)
        masters = full_optimizer_state(engine, "master")
        start = clone_state(engine)  # rank 0: the 16-bit parameters, upcast
        r["masters_are_16bit_values"] = (len(masters) == 4 and all(torch.equal(masters[n], start[n].reshape(-1))
                                                                  for n in masters)) if rank == 0 else None
        r["losses"] = engine_run(engine, world, rank, dtype=dtype)
        r["params"] = clone_state(engine)
        engine.destroy()
        out[precision] = r
    # an explicit dtype wins over the config; a config without bf16/fp16 means fp32; no config keeps the build dtype
    with Init(config_dict_or_path=_precision_config("bf16"), dtype=torch.float32):
        out["explicit_fp32"] = _dtypes(make_model())
    with Init(config_dict_or_path=base_config(3)):
        out["fp32_config"] = _dtypes(nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16)))
    with Init():
        out["no_config"] = _dtypes(make_model())
    out["from_pretrained"] = _from_pretrained(tmp_dir, rank)
    return out


def _from_pretrained(tmp_dir: str, rank: int) -> dict:
    """transformers' ZeRO-3 loading (test_init_zero3_bf16): the checkpoint's fp32 values land in bf16 shards."""
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from _zero3_util import _HF_DS_CONFIG, enable_transformers_zero3, tiny_llama_config

    from hf_zero.zero import GatheredParameters

    enable_transformers_zero3()
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_dir)
    dist.barrier()
    _HF_DS_CONFIG.append(HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                            "train_micro_batch_size_per_gpu": 1}))
    model = LlamaForCausalLM.from_pretrained(tmp_dir)
    from safetensors.torch import load_file

    saved = load_file(f"{tmp_dir}/model.safetensors")
    out = {"model_dtype": model.dtype, "ds_tensor": {p.ds_tensor.dtype for p in model.parameters()},
           "buffers": {n: b.dtype for n, b in model.named_buffers()}}
    with GatheredParameters(list(model.parameters())):
        out["loaded_rounded"] = all(torch.equal(p, saved[n].to(torch.bfloat16)) for n, p in model.named_parameters()
                                    if n in saved)
    _HF_DS_CONFIG.pop()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_run, 2, args=(str(tmp_path_factory.mktemp("llama")),), timeout_s=300)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero_init_builds_in_the_config_dtype(results, precision):
    dtype = DTYPES[precision]
    for rank_result in results:
        r = rank_result[precision]
        assert r["param"] == {dtype} and r["ds_tensor"] == {dtype}
        assert r["gathered"] == (dtype, (37, 13))
        assert r["buffers"] == {"running_mean": dtype, "running_var": dtype, "num_batches_tracked": torch.int64}
        assert r["values_are_rounded_init"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_masters_start_from_the_16bit_values_and_training_tracks_the_reference(results, precision):
    ref_losses, ref_params = reference_run(2)
    r = results[0][precision]
    assert r["masters_are_16bit_values"]
    assert results[1][precision]["losses"] == r["losses"]
    # the bounds of tests/test_engine_precision.py
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=2e-2, atol=1e-3)
    for name, ref in ref_params.items():
        diff = (r["params"][name] - ref).abs()
        assert diff.max() < 5e-2, f"{precision} {name}: max |diff| {diff.max():.4g}"
        assert diff.mean() < 5e-2 / 20, f"{precision} {name}: mean |diff| {diff.mean():.4g}"


def test_explicit_dtype_fp32_config_and_no_config(results):
    r = results[0]
    assert r["explicit_fp32"]["param"] == {torch.float32} and r["explicit_fp32"]["ds_tensor"] == {torch.float32}
    assert r["fp32_config"]["param"] == {torch.float32}  # a bf16-built layer becomes fp32, as DeepSpeed's cast
    assert r["no_config"]["param"] == {torch.float32} and r["no_config"]["gathered"][0] == torch.float32


def test_from_pretrained_under_zero3_bf16(results):
    for rank_result in results:
        r = rank_result["from_pretrained"]
        assert r["model_dtype"] == torch.bfloat16 and r["ds_tensor"] == {torch.bfloat16}
        assert set(r["buffers"].values()) == {torch.bfloat16}  # rotary inv_freq too, as under DeepSpeed
        assert r["loaded_rounded"]
