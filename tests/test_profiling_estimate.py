"""`hf-zero estimate` from a config file alone, the step-time roofline, and DeepSpeed's estimator names."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_zero.profiling.memory import CPU_RUNTIME_BYTES, estimate_memory, param_layout
from hf_zero.profiling.steptime import Hardware, StepTimeModel

ROOT = Path(__file__).resolve().parents[1]


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("estimate")
    _llama_config().to_json_file(d / "config.json")
    (d / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2,
                                           "bf16": {"enabled": True}}))
    return d


def _cli(*args) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, "-m", "hf_zero", "estimate", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


# between the smallest (~0.0018 GiB) and the largest (~0.0048 GiB) predicted peak, over the CPU runtime constant
SWEEP_BUDGET_GIB = CPU_RUNTIME_BYTES / 2**30 + 0.0028


@pytest.fixture(scope="module")
def cli(files):
    """The three CLI runs the tests below check, started together (each is one process, mostly imports: side by
    side they use both cores); ``cli[name]()`` waits for one and returns it as a CompletedProcess."""
    procs = {
        "json": _cli("--model-config", str(files / "config.json"), "--ds-config", str(files / "ds.json"),
                     "--world-size", "2", "--seq-len", "32", "--accelerator", "cpu", "--json"),
        # the model positionally, as `accelerate estimate-memory MODEL` takes it
        "table": _cli(str(files), "--ds-config", str(files / "ds.json"), "--seq-len", "32",
                      "--accelerator", "cpu", "--device-memory-gib", "0.001"),
        "sweep": _cli("--model-config", str(files / "config.json"), "--ds-config", str(files / "ds.json"),
                      "--world-size", "2", "--seq-len", "64", "--micro-batch", "4", "--accelerator", "cpu", "--sweep",
                      "--json", "--device-memory-gib", str(SWEEP_BUDGET_GIB), "--peak-tflops", "1"),
    }
    done = {}

    def result(name: str) -> subprocess.CompletedProcess:
        if name not in done:
            out, err = procs[name].communicate(timeout=240)
            done[name] = subprocess.CompletedProcess(procs[name].args, procs[name].returncode, out, err)
        return done[name]

    yield {name: (lambda name=name: result(name)) for name in procs}
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_estimate_from_config_file_alone_json_matches_the_library(files, cli):
    run = cli["json"]()
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["inputs"]["params"] == sum(p.numel() for p in _meta_model().parameters())
    assert out["inputs"]["stage"] == 2 and out["inputs"]["micro_batch"] == 2 and out["inputs"]["dtype"] == "bfloat16"
    # the same components as the library on the real model (activations traced per sequence, times 2)
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    ref = estimate_memory(LlamaForCausalLM(_llama_config()), json.loads((files / "ds.json").read_text()),
                          world_size=2, seq_len=32, accelerator="cpu")
    by_name = {c["name"]: c["nbytes"] for c in out["components"]}
    for c in ref.components:
        if c.phase == "states":
            assert by_name[c.name] == c.nbytes, c.name
    assert by_name["activations + backward temporaries"] > 0
    assert out["peak_bytes"]["accelerator"] > ref.model_states()
    assert out["fits"] is True


def _meta_model():
    from hf_zero.profiling.memory import build_meta_model

    return build_meta_model(_llama_config())


def test_estimate_table_and_does_not_fit_exit_code(cli):
    run = cli["table"]()
    assert run.returncode == 1
    assert "does NOT fit" in run.stdout and "master (fp32 shard)" in run.stdout and "peak accelerator" in run.stdout


def test_sweep_ranks_only_configs_that_fit(cli):
    budget_gib = SWEEP_BUDGET_GIB
    run = cli["sweep"]()
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert len(out["all"]) == 7 * 3 * 2  # 7 stage/offload pairs x micro 1,2,4 x checkpointing off/on
    assert 0 < len(out["fits"]) < len(out["all"])
    assert all(r["peak_accelerator_bytes"] <= budget_gib * 2**30 for r in out["fits"])
    assert all(r["peak_accelerator_bytes"] > budget_gib * 2**30 for r in out["all"] if not r["fits"])
    rates = [r["tokens_per_s"] for r in out["fits"]]
    assert rates == sorted(rates, reverse=True)


def test_step_time_calibration_reproduces_the_measured_median():
    model = StepTimeModel(Hardware(peak_tflops=100.0))
    work = dict(model_flops_per_rank=3e13, params=10**9, trainable=10**9, stage=2, world_size=8)
    parts = model.breakdown(**work)
    assert parts["step"] == pytest.approx(sum(v for k, v in parts.items() if k != "step"))
    assert parts["compute"] == pytest.approx(3e13 / (100e12 * 0.45))
    calibrated = model.calibrate([2.0, 1.5, 9.0], **work)
    assert calibrated.breakdown(**work)["step"] == pytest.approx(2.0)
    assert calibrated.breakdown(**work)["communication"] == pytest.approx(parts["communication"])


def test_deepspeed_estimators_print_hf_zero_numbers(capsys):
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs_all_cold,
                                               estimate_zero3_model_states_mem_needs_all_live)
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs_all_cold,
                                                      estimate_zero2_model_states_mem_needs_all_live)
    from transformers import LlamaForCausalLM

    import hf_zero
    from hf_zero.profiling.ds_estimators import zero_model_states_mem_needs

    with hf_zero.zero.Init():  # partitioned at construction: p.numel() is 0 for every weight
        model = LlamaForCausalLM(_llama_config())
    assert sum(p.numel() for p in model.parameters()) < 1000
    layout = param_layout(model)
    assert layout.total == sum(p.numel() for p in _meta_model().parameters())
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=4)
    live = capsys.readouterr().out
    lines = live.splitlines()
    assert lines[0] == "Estimated memory needed for params, optim states and gradients for a:"
    assert lines[1] == "HW: Setup with 1 node, 4 GPUs per node."
    assert lines[3] == "  per CPU  |  per GPU |   Options"
    assert len(lines) == 4 + 6 + 1 and "hf-zero estimate" in lines[-1]
    # the no-offload row: 16-bit shard + fp32 master + bf16 gradient shard + Adam moments, 1/4 per GPU
    cpu, gpu = zero_model_states_mem_needs(layout, stage=3, num_gpus_per_node=4)
    assert gpu > 0 and f"{gpu / 2**30:6.2f}GB | offload_param=none, offload_optimizer=none, zero_init=1" in live
    estimate_zero3_model_states_mem_needs_all_cold(layout.total, layout.largest_module_numel)
    estimate_zero2_model_states_mem_needs_all_live(model)
    estimate_zero2_model_states_mem_needs_all_cold(layout.total, num_gpus_per_node=2)
    out = capsys.readouterr().out
    assert out.count("per CPU  |  per GPU") == 3 and out.count("hf-zero estimate") == 3


@pytest.mark.parametrize("args,message", [
    ((), "which model\\? Give its config.json"),
    (("a", "--model-config", "b"), "got the model twice \\('a' and --model-config 'b'\\)"),
])
def test_estimate_without_a_model_or_with_two_says_so(args, message):
    run = _cli(*args)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 2 and re.search(message, err), err
