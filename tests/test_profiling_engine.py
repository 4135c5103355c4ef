"""The ``flops_profiler`` config section and DeepSpeed's profiler API (FlopsProfiler, get_model_profile)."""

import os
import re

import pytest
import torch
from torch import nn

import hf_zero
from hf_zero.profiling.analytic import analytic_flops
from hf_zero.profiling.profiler import FlopsProfiler, get_model_profile
from hf_zero.testing import run_distributed

B, S, GAS, STEPS = 2, 16, 2, 3


def llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return cfg, LlamaForCausalLM(cfg)


def _hook_counts(model: nn.Module) -> tuple:
    per_module = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                     for m in model.modules())
    return (per_module, len(nn.modules.module._global_forward_pre_hooks),
            len(nn.modules.module._global_forward_hooks), id(torch.nn.functional.linear))


def _train(stage: int, profiler: dict | None):
    import torch.distributed as dist

    cfg, model = llama()
    ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": GAS, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100}}
    if profiler is not None:
        ds["flops_profiler"] = profiler
    engine, *_ = hf_zero.initialize(model=model, config=ds)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(10 + rank)
    losses, hooks = [], []
    for _ in range(STEPS):
        for _ in range(GAS):
            ids = torch.randint(0, 128, (B, S), generator=g)
            mask = torch.ones(B, S, dtype=torch.long)
            mask[0, -4:] = 0  # 4 padding tokens per micro-batch
            loss = engine(input_ids=ids, attention_mask=mask, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        hooks.append(_hook_counts(engine.module))
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if stage == 3:
        from hf_zero.zero import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    sp = engine.step_profiler
    cal = engine.step_time_model
    cal = (cal.predicted_step_s, cal.measured_s, cal.workload["model_flops_per_rank"]) if cal is not None else None
    return dict(losses=losses, params=params, hooks=hooks, text=sp.last_report, report=sp.report, figures=sp.figures,
                analytic=analytic_flops(cfg, B, S), calibration=cal)


def _both(stage: int, out: str):
    profiler = {"enabled": True, "profile_step": 1, "module_depth": 2, "top_modules": 2, "detailed": True,
                "output_file": out, "recompute_fwd_factor": 1.0}
    return _train(stage, None), _train(stage, profiler)


def _stages_2_and_3(out2: str, out3: str):
    return {2: _both(2, out2), 3: _both(3, out3)}


def _check(results, out_file, stage: int):
    results = [by_stage[stage] for by_stage in results]
    for rank, (plain, profiled) in enumerate(results):
        assert profiled["losses"] == plain["losses"], f"stage {stage} rank {rank}: profiling changed the losses"
        for name, p in plain["params"].items():
            assert torch.equal(profiled["params"][name], p), f"stage {stage} rank {rank}: {name} differs"
        assert profiled["hooks"] == plain["hooks"], "profiling left hooks behind"
        # one optimizer step (GAS micro-steps) counted, on every rank; exact against the analytic count
        report, expected = profiled["report"], profiled["analytic"]
        assert report.forward == GAS * expected.forward
        assert report.model == GAS * expected.training
        assert plain["report"] is None
        # the step-time roofline calibrated itself on steps 2 and 3 (step 1 is the warm-up): the median of them
        predicted, measured, flops = plain["calibration"]
        assert len(measured) == STEPS - 1 and predicted == pytest.approx(sorted(measured)[len(measured) // 2])
        assert flops == GAS * expected.training
    text = open(out_file).read()
    assert results[0][1]["text"] == text.rstrip("\n")
    assert results[1][1]["text"] is None, "only rank 0 prints"
    return text


def test_flops_profiler_section_reports_at_profile_step_and_changes_nothing(tmp_path):
    out, out3 = str(tmp_path / "prof" / "flops.txt"), str(tmp_path / "flops3.txt")
    results = run_distributed(_stages_2_and_3, 2, args=(out, out3), timeout_s=300)
    text = _check(results, out, 2)
    expected = results[0][2][1]["analytic"]
    assert "Profile Summary at step 1:" in text
    assert re.search(r"world size:\s+2", text) and re.search(r"batch size per GPU:\s+2", text)
    assert re.search(rf"micro-batches in this step \(every figure below covers them all\):\s+{GAS} *\n", text)
    fwd = GAS * expected.forward
    assert re.search(rf"fwd flops per GPU:\s+{round(fwd / 1e6, 2):g} M", text), text
    assert "params of model (true sizes, every ZeRO stage):" in text
    # tokens from the attention mask: (B * S - 4) per micro-batch
    tokens = GAS * (B * S - 4)
    assert re.search(r"tokens/second per GPU:\s+[\d.]+", text)
    assert results[0][2][1]["report"].by_module["model.layers.0"] > 0
    # recompute_fwd_factor keeps DeepSpeed's meaning in its lines, and the counted backward disagrees: warned
    assert "bwd FLOPS per GPU = 3 * fwd flops per GPU / bwd latency" in text
    assert re.search(r"warning: flops_profiler.recompute_fwd_factor 1 implies a backward of 3 x forward, but the "
                     r"counted backward is 2\.\d+ x forward", text)
    # module_depth 2, top_modules 2: depths 0..2, two classes listed where there are two
    assert [line for line in text.splitlines() if line.startswith("depth ")] == ["depth 0:", "depth 1:", "depth 2:"]
    assert "Detailed Profile per GPU" in text and "(layers): ModuleList" in text
    assert "(self_attn)" not in text  # deeper than module_depth
    assert "MFU: " in text and "not reported: no dense peak known for cpu" in text
    assert [r[2][1]["figures"].tokens for r in results] == [tokens, tokens]
    assert [r[2][1]["figures"].samples for r in results] == [GAS * B, GAS * B]
    # stage 3: the same exact counts, and the true parameter count, not the local shard DeepSpeed's profiler shows
    text3 = _check(results, out3, 3)
    total = sum(p.numel() for p in llama()[1].parameters())
    assert re.search(rf"params of model \(true sizes, every ZeRO stage\):\s+{round(total / 1e3, 2):g} K", text3)




def test_get_model_profile_returns_deepspeed_shapes_with_counted_numbers(tmp_path, capsys):
    cfg, model = llama()
    ids = torch.randint(0, 128, (B, S))
    before = _hook_counts(model)
    flops, macs, params = get_model_profile(model, kwargs={"input_ids": ids}, print_profile=True, detailed=False,
                                            as_string=False, output_file=str(tmp_path / "p.txt"))
    expected = analytic_flops(cfg, B, S)
    assert flops == expected.forward and macs == expected.forward // 2
    assert params == sum(p.numel() for p in model.parameters())
    assert _hook_counts(model) == before
    assert "Detailed Profile" not in (tmp_path / "p.txt").read_text()
    s_flops, s_macs, s_params = get_model_profile(model, args=[ids], print_profile=False)
    assert (s_flops, s_macs) == (f"{round(flops / 1e6, 2):g} M", f"{round(macs / 1e6, 2):g} MMACs")
    assert s_params == f"{round(params / 1e3, 2):g} K"


def test_flops_profiler_counts_forward_only_like_deepspeed():
    cfg, model = llama()
    ids = torch.randint(0, 128, (B, S))
    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # backward inside the profiled interval: counted separately, not in get_total_flops
    prof.stop_profile()
    expected = analytic_flops(cfg, B, S)
    assert prof.get_total_flops() == expected.forward
    prof.print_model_profile(output_file=os.devnull)  # DeepSpeed's profiler keeps the printed figures
    assert (prof.flops, prof.macs) == (expected.forward, expected.forward // 2)
    assert prof.params == sum(p.numel() for p in model.parameters())
    assert prof.report.model == expected.training
    assert prof.get_total_duration() > 0
    prof.end_profile()
    assert prof.get_total_flops() == 0
    assert not nn.modules.module._global_forward_hooks


def test_deepspeed_names_reach_hf_zero_profiler():
    from deepspeed.profiling.flops_profiler import FlopsProfiler as DsFlopsProfiler
    from deepspeed.profiling.flops_profiler import get_model_profile as ds_get_model_profile
    from deepspeed.profiling.flops_profiler.profiler import get_model_profile as ds_get_model_profile2

    assert DsFlopsProfiler is FlopsProfiler and ds_get_model_profile is ds_get_model_profile2 is get_model_profile
    cfg, model = llama()
    flops, _, params = ds_get_model_profile(model, input_shape=None, args=[torch.randint(0, 128, (B, S))],
                                            print_profile=False, as_string=False)
    assert flops == analytic_flops(cfg, B, S).forward


def _engine_flops_profiler(section: dict | None):
    """DeepSpeed's test_flops_profiler, with two micro-batches of different sizes per step: Linear(10, 10)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10))
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if section is not None:
        ds["flops_profiler"] = section
    engine, *_ = hf_zero.initialize(model=model, config=ds)
    out = {"getters": (engine.flops_profiler_enabled(), engine.flops_profiler_profile_step(),
                       engine.flops_profiler_module_depth(), engine.flops_profiler_top_modules()),
           "has": hasattr(engine, "flops_profiler")}
    if section is None:
        try:
            engine.flops_profiler
        except AttributeError as missing:
            out["missing"] = str(missing)
        return out
    for step in range(3):
        if step == 1:  # nothing profiled yet: a clear error, not a None in arithmetic
            with pytest.raises(RuntimeError, match="no step profiled yet .*profile_step is 1"):
                engine.flops_profiler.get_total_flops()
        for rows in (4, 2):  # the last micro-batch of each step has 2 rows
            x = torch.randn(rows, 10)
            loss = nn.functional.cross_entropy(engine(x), torch.zeros(rows, dtype=torch.long))
            engine.backward(loss)
            engine.step()
    prof = engine.flops_profiler
    out.update(flops=prof.flops, macs=prof.macs, params=prof.params, total=prof.get_total_flops(),
               text=prof.get_total_flops(as_string=True), params_text=prof.get_total_params(as_string=True),
               step_flops=prof.report.forward, duration=prof.get_total_duration())
    return out


def test_engine_flops_profiler_holds_deepspeeds_figures_of_the_profiled_step(tmp_path):
    section = {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 3,
               "output_file": str(tmp_path / "p.txt")}
    on = run_distributed(_engine_flops_profiler, 1, args=(section,), timeout_s=120)[0]
    assert on["getters"] == (True, 1, -1, 3) and on["has"]
    # DeepSpeed restarts its count at every forward: flops is the last micro-batch's (2 rows x 2 x 10 x 10)
    assert (on["flops"], on["macs"], on["total"]) == (400, 200, 400)
    assert on["step_flops"] == 1200  # the report covers the step: 4 rows + 2 rows
    assert on["params"] == 110 and on["params_text"] == "110"
    assert on["text"] == "400 " and on["duration"] > 0  # DeepSpeed's format, trailing space included
    off = run_distributed(_engine_flops_profiler, 1, args=(None,), timeout_s=120)[0]
    assert off["getters"] == (False, 1, -1, 1) and not off["has"]  # absent when disabled, as in DeepSpeed
    assert off["missing"] == "engine.flops_profiler exists when the config's flops_profiler.enabled is true (as in " \
                             "DeepSpeed)"
