"""``torch_autocast`` together with ``bf16.enabled`` (or ``fp16.enabled``) (#26 item 3), on 2 ranks.

DeepSpeed 0.19.8 accepts the combination and applies both: the bf16 section casts the parameters (fp32 masters in
the optimizer, bf16 ones with ``bf16_master_weights_and_grads``) and ``forward`` still runs under
``torch.autocast``, so fp32 inputs are taken and autocast's fp32 ops run in fp32. Measured on CPU (gloo, 1 rank,
``Sequential(Linear(8, 8), LayerNorm(8), Linear(8, 4))``, AdamW lr 1e-2, fp32 inputs): parameters bf16 at stages
0-2, output bf16, losses 3.0890 -> 2.6752 -> 2.2954 at stage 1/2 (2.6743, 2.2997 with bf16 master weights and
optimizer states); the same config without ``torch_autocast`` fails on the fp32 input ("mat1 and mat2 must have
the same dtype"). hf_zero did refuse the combination; here it behaves as DeepSpeed does:
- the parameters are bf16 and the masters fp32 (bf16 with ``bf16_master_weights_and_grads``);
- ``engine(x)`` with an fp32 ``x`` equals, bit for bit, the bf16-cast model run under ``torch.autocast``;
- training tracks the fp32 single-process reference within bf16's precision (stages 0, 1, 2, and the bf16
  master-weight config at stage 1).
fp16 with ``torch_autocast`` float16 (DeepSpeed runs it on a GPU; on the CPU it refuses fp16 itself): fp16
parameters, the fp16 section's loss scaler, the same forward equality, and it trains.

DeepSpeed 0.19.8's run of this test's stage-1 and stage-2 bf16 cases (same model, data and config from _parity.py,
2 CPU ranks, gloo, DS_ACCELERATOR=cpu, ``torch_adam`` as its CPU build has no fused Adam) gave the losses in
``DEEPSPEED_LOSSES``; hf_zero's stay within bf16 rounding of them.
"""

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.testing import run_distributed

from _parity import base_config, clone_state, engine_run, make_data, make_model, reference_run

WORLD = 2
AUTOCAST = {"enabled": True, "dtype": "bfloat16"}
BF16_CASES = {  # name: (ZeRO stage, bf16 section)
    "z0": (0, {"enabled": True}),
    "z1": (1, {"enabled": True}),
    "z2": (2, {"enabled": True}),
    "z1-bf16-master": (1, {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
}
DEEPSPEED_LOSSES = {
    1: [1.069, 1.2565, 0.9737, 1.0192, 1.1979, 0.9579, 0.932, 0.8813, 0.9371, 1.2138],
    2: [1.069, 1.2565, 0.9738, 1.0193, 1.1977, 0.9581, 0.9321, 0.881, 0.9373, 1.2145],
}


def _forward_matches(engine, dtype: torch.dtype) -> bool:
    """The engine's forward on an fp32 input is the 16-bit-cast model's forward under torch.autocast."""
    x = make_data(WORLD, 1)[0][0, 0, dist.get_rank()]
    reference = make_model().to(dtype)
    with torch.no_grad():
        got = engine(x)
        with torch.autocast("cpu", dtype=dtype):
            want = reference(x)
    return got.dtype == want.dtype and torch.equal(got, want)


def _train():
    rank = dist.get_rank()
    out = {}
    for name, (stage, bf16) in BF16_CASES.items():
        engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(stage, bf16=bf16,
                                                                                torch_autocast=AUTOCAST))
        out[name] = dict(params={p.dtype for p in engine.module.parameters()},
                         masters={g.master.dtype for g in engine.groups},
                         forward=_forward_matches(engine, torch.bfloat16),
                         autocast=engine.torch_autocast_dtype(),
                         losses=engine_run(engine, WORLD, rank), state=clone_state(engine))  # fp32 inputs
        engine.destroy()
    fp16 = {"enabled": True, "initial_scale_power": 8}
    engine, *_ = hf_zero.initialize(model=make_model(), config=base_config(1, fp16=fp16, torch_autocast={
        "enabled": True, "dtype": "float16"}))
    out["fp16"] = dict(params={p.dtype for p in engine.module.parameters()}, scaler=engine.loss_scaler is not None,
                       forward=_forward_matches(engine, torch.float16), losses=engine_run(engine, WORLD, rank, steps=4))
    engine.destroy()
    return out


def test_torch_autocast_with_bf16_trains_as_deepspeed():
    ref_losses, ref_params = reference_run(WORLD)
    results = run_distributed(_train, WORLD, timeout_s=300)
    for name in BF16_CASES:
        r = results[0][name]
        master = torch.bfloat16 if "master" in name else torch.float32
        assert (r["params"], r["masters"], r["forward"], r["autocast"]) == (
            {torch.bfloat16}, {master}, True, torch.bfloat16), name
        # bf16 weights carry ~3 significant digits (the bf16 test's tolerances, test_engine_precision.py)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=2e-2, atol=1e-3,
                                   msg=lambda m: f"{name}: {m}")
        if name in ("z1", "z2"):
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(DEEPSPEED_LOSSES[int(name[1])]),
                                       rtol=3e-3, atol=0, msg=lambda m: f"{name} against DeepSpeed: {m}")
        for key, ref in ref_params.items():
            diff = (r["state"][key] - ref).abs()
            assert diff.max() < 5e-2 and diff.mean() < 5e-2 / 20, (name, key, float(diff.max()))
        for other in results[1:]:  # every rank holds the same weights
            assert other[name]["forward"]
            for key, t in r["state"].items():
                assert torch.equal(other[name]["state"][key], t), (name, key)
    for r in results:
        fp16 = r["fp16"]
        assert (fp16["params"], fp16["scaler"], fp16["forward"]) == ({torch.float16}, True, True)
        torch.testing.assert_close(torch.tensor(fp16["losses"]), torch.tensor(ref_losses[:4]), rtol=2e-2, atol=1e-3)
