"""Floating buffers under bf16, as DeepSpeed 0.19.8 treats them (hf_zero/zero/buffer_dtypes.py).

DeepSpeed 0.19.8 casts parameters only (``_cast_module_mixed_precision``: "preserve fp32 buffers (e.g. rotary
inv_freq) unless buffer_dtype is set"); older releases called ``module.bfloat16()``/``module.half()``. So a model with
``BatchNorm1d`` fails in its first forward at every stage with bf16 alone, and trains with
``"data_types": {"buffer_dtype": "bf16"}``. DeepSpeed's run of the same script (Linear(8,16) -> BatchNorm1d(16) -> ReLU
-> Linear(16,1), seed 0, AdamW lr 1e-2 ``torch_adam``, micro-batch 4 per rank, 2 CPU ranks with gloo,
``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu``; global mean loss per step):

    bf16 alone, stages 0/2/3:   RuntimeError "expected scalar type BFloat16 but found Float" in forward;
                                running_mean/running_var float32, parameters bfloat16
    + buffer_dtype "bf16":      running_mean/running_var bfloat16 (num_batches_tracked int64) at stages 0, 2 and 3
        stage 0 losses  13.011749, 8.913662, 13.917601, 13.475142
        stage 2, 3      13.011749, 8.819120, 13.922162, 13.296672
        rank 0 running_mean[:3] after 4 steps, stages 2/3: -0.0718, -0.1113, -0.0549

hf_zero gives 13.011749, 8.814046, 13.923901, 13.298123 at every stage (rank 0 running_mean[:3] -0.0698, -0.1118,
-0.0566): the first step is bit-identical, the rest within 0.06 % of DeepSpeed's stages 2/3 and 1.3 % of its stage 0
(whose bf16 path updates differently; the 2e-2 relative bound is the one the bf16 parity tests use). Without
``buffer_dtype`` hf_zero refuses at initialize, naming the key, instead of failing in forward.

fp16 (DeepSpeed's ``module.half()`` question), the same script with ``fp16.enabled`` (default loss scaling):
DeepSpeed fails at every stage with "expected scalar type Half but found Float" unless ``buffer_dtype: "fp16"``;
with it, stages 2 and 3 give 13.008264, 9.239029, 14.180226, 14.346144 and stage 0 13.008264, 8.929170, 13.931321,
13.467098 (its stage-0 fp16 optimizer treats the first, overflowing, scale differently). hf_zero gives DeepSpeed's
stage 2/3 numbers bit for bit at stages 0, 2 and 3.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero.testing import run_distributed

DS_LOSSES = {0: [13.011749267578125, 8.91366195678711, 13.917600631713867, 13.475141525268555],
             2: [13.011749267578125, 8.819120407104492, 13.922162055969238, 13.296671867370605],
             3: [13.011749267578125, 8.819120407104492, 13.922162055969238, 13.296671867370605]}
DS_RUNNING_MEAN_RANK0 = [-0.07177734375, -0.111328125, -0.054931640625]  # stages 2 and 3
DS_FP16_LOSSES_STAGES_2_3 = [13.00826358795166, 9.239028930664062, 14.18022632598877, 14.34614372253418]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _config(stage: int, precision: str = "bf16", **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, precision: {"enabled": True}, "steps_per_print": 10**6}
    cfg.update(extra)
    return cfg


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _train(engine, rank: int, world: int, dtype=torch.bfloat16) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(world, 4, 8, generator=g)
        y = x.sum(-1, keepdim=True)
        loss = (engine(x[rank].to(dtype)).float() - y[rank]).square().mean()
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


class _Listed(nn.Module):
    """A transformers-style module naming a buffer for fp32 (DeepSpeed's keep_in_fp32 case: a routing bias)."""

    _keep_in_fp32_modules_strict = ["router"]

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.router = nn.Module()
        self.router.register_buffer("bias", torch.linspace(5, 5.01, 4))
        self.register_buffer("scale", torch.full((4,), 1.0 / 3))


def _check() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"losses": {}, "buffers": {}}
    for stage in (0, 2, 3):
        engine, *_ = hf_zero.initialize(model=_model(), config=_config(stage, data_types={"buffer_dtype": "bf16"}))
        out["buffers"][stage] = {n: b.dtype for n, b in engine.module.named_buffers()}
        out["losses"][stage] = _train(engine, rank, world)
        out.setdefault("running_mean", {})[stage] = engine.module[1].running_mean[:3].float().tolist()
        engine.destroy()
    for stage in (0, 2, 3):
        engine, *_ = hf_zero.initialize(model=_model(), config=_config(stage, "fp16",
                                                                       data_types={"buffer_dtype": "fp16"}))
        out.setdefault("fp16_buffers", {})[stage] = {n: b.dtype for n, b in engine.module.named_buffers()}
        out.setdefault("fp16_losses", {})[stage] = _train(engine, rank, world, torch.float16)
        engine.destroy()
    # 16-bit alone: refused at initialize, naming the key (DeepSpeed fails in forward)
    for precision in DTYPES:
        try:
            hf_zero.initialize(model=_model(), config=_config(2, precision))
            out.setdefault("refused", {})[precision] = None
        except hf_zero.ConfigError as err:
            out.setdefault("refused", {})[precision] = str(err)
    # keep_in_fp32_modules "auto": the listed buffer stays fp32 (its values too), the others follow buffer_dtype
    m = _Listed()
    engine, *_ = hf_zero.initialize(model=m, config=_config(2, data_types={"buffer_dtype": "bf16"}))
    out["listed"] = {n: (b.dtype, b.float().tolist()) for n, b in engine.module.named_buffers()}
    engine.destroy()
    m = _Listed()
    engine, *_ = hf_zero.initialize(model=m, config=_config(2, data_types={"buffer_dtype": "bf16",
                                                                           "keep_in_fp32_modules": []}))
    out["listed_none"] = {n: b.dtype for n, b in engine.module.named_buffers()}
    engine.destroy()
    # under zero.Init the buffers are built in bf16 (DeepSpeed's constructors), so bf16 alone trains
    from hf_zero.zero import Init

    cfg = _config(3)
    with Init(config_dict_or_path=cfg):
        model = _model()
    out["init_buffers"] = {n: b.dtype for n, b in model.named_buffers()}
    engine, *_ = hf_zero.initialize(model=model, config=cfg)
    out["init_losses"] = _train(engine, rank, world)
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_check, 2, timeout_s=240)


def test_buffer_dtype_bf16_casts_buffers_and_trains_like_deepspeed(results):
    r = results[0]
    for stage in (0, 2, 3):
        assert r["buffers"][stage] == {"1.running_mean": torch.bfloat16, "1.running_var": torch.bfloat16,
                                       "1.num_batches_tracked": torch.int64}
        losses = torch.tensor(r["losses"][stage])
        assert torch.isfinite(losses).all()
        assert losses[0].item() == DS_LOSSES[stage][0]  # before any update: bit-identical to DeepSpeed
        torch.testing.assert_close(losses, torch.tensor(DS_LOSSES[stage]), rtol=2e-2, atol=0)
        torch.testing.assert_close(torch.tensor(r["running_mean"][stage]), torch.tensor(DS_RUNNING_MEAN_RANK0),
                                   rtol=0, atol=5e-3)
        assert results[1]["losses"][stage] == r["losses"][stage]


def test_buffer_dtype_fp16_trains_like_deepspeed(results):
    r = results[0]
    for stage in (0, 2, 3):
        assert r["fp16_buffers"][stage] == {"1.running_mean": torch.float16, "1.running_var": torch.float16,
                                            "1.num_batches_tracked": torch.int64}
        torch.testing.assert_close(torch.tensor(r["fp16_losses"][stage]), torch.tensor(DS_FP16_LOSSES_STAGES_2_3),
                                   rtol=1e-5, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_without_buffer_dtype_is_refused_naming_the_key(results, precision):
    msg = results[0]["refused"][precision]
    assert msg is not None and msg.startswith("data_types.buffer_dtype: unset")
    assert f"'1' (BatchNorm1d: {DTYPES[precision]} weight, torch.float32 running statistics)" in msg
    assert f'"buffer_dtype": "{precision}"' in msg


def test_keep_in_fp32_modules(results):
    listed = results[0]["listed"]
    assert listed["router.bias"][0] == torch.float32
    assert listed["router.bias"][1] == torch.linspace(5, 5.01, 4).tolist()  # never rounded through bf16
    assert listed["scale"][0] == torch.bfloat16
    assert results[0]["listed_none"] == {"router.bias": torch.bfloat16, "scale": torch.bfloat16}


def test_zero_init_builds_buffers_in_bf16_and_trains(results):
    r = results[0]
    assert r["init_buffers"] == {"1.running_mean": torch.bfloat16, "1.running_var": torch.bfloat16,
                                 "1.num_batches_tracked": torch.int64}
    torch.testing.assert_close(torch.tensor(r["init_losses"]), torch.tensor(DS_LOSSES[3]), rtol=2e-2, atol=0)


def test_param_dtype_must_match_the_precision_mode():
    from hf_zero.config import load_config

    base = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    assert load_config({**base, "data_types": {"param_dtype": "bf16"}}, world_size=1).data_types.param_dtype == "bf16"
    with pytest.raises(hf_zero.ConfigError, match=r"^data_types.param_dtype: 'fp16' conflicts with the enabled "
                                                  r"precision mode \(bf16\)"):
        load_config({**base, "data_types": {"param_dtype": "fp16"}}, world_size=1)
    with pytest.raises(hf_zero.ConfigError, match=r"^data_types.buffer_dtype: value 'int8'"):
        load_config({**base, "data_types": {"buffer_dtype": "int8"}}, world_size=1)
