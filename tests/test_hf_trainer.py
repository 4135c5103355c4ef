"""The HF ``Trainer`` with ``TrainingArguments(deepspeed=...)`` on hf_zero, 2 CPU processes, no real DeepSpeed.

Every run is ``examples/train_trainer.py`` under ``torchrun --nproc_per_node 2`` from the same local "pretrained"
tiny Llama, so the runs differ only in the engine:

- plain DDP (``--use_cpu``, no DeepSpeed config) is the reference;
- ZeRO-2 *without* ``use_cpu`` (what DeepSpeed cannot do on a CPU-only machine) with ``load_best_model_at_end``;
- ZeRO-2 resumed from its step-4 checkpoint;
- ZeRO-1, and stage 0 resumed from ZeRO-1's step-4 checkpoint;
- ZeRO-3 with ``use_cpu=True`` (the path real DeepSpeed documents, which fails in ``from_pretrained`` there), with
  ``torch_compile_backend`` (accelerate calls the engine's ``compile()``);
- ZeRO-3 with optimizer and parameter offload to CPU.

Checked: per-step losses against DDP (1e-3 relative), the trained weights (logits on a fixed input) against DDP,
the resumed loss curve against the uninterrupted one, and that each saved ``model.safetensors`` is complete and
reloads with ``from_pretrained`` to the same logits as the engine's consolidated weights. (ZeRO-3 resume is
covered by ``test_hf_peft.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _hf_env import EXAMPLES, INTEGRATIONS, make_venv, rel_close, tiny_base_model, torchrun

SCRIPT = EXAMPLES / "train_trainer.py"
RTOL = 1e-3


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_trainer")
    python = make_venv(root / "venv")
    base = tiny_base_model(root / "base")
    return {"root": root, "python": python, "base": base, "runs": {}}


def _train(work: dict, name: str, *args: str) -> dict:
    """Run the Trainer example once (cached per name); returns its metrics plus the output directory."""
    if name not in work["runs"]:
        out = work["root"] / name
        metrics = work["root"] / f"{name}.json"
        torchrun(work["python"], SCRIPT, ["--model_name_or_path", str(work["base"]), "--output_dir", str(out),
                                          "--max_steps", "8", "--save_steps", "4", "--metrics_out", str(metrics),
                                          "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                                          *args], cwd=work["root"])
        result = json.loads(metrics.read_text())
        result["losses"] = {int(k): v for k, v in result["losses"].items()}
        result["logits"] = torch.load(str(metrics) + ".logits.pt")
        result["dir"] = out
        work["runs"][name] = result
    return work["runs"][name]


def _ddp(work):
    return _train(work, "ddp", "--use_cpu", "--zero_log_detail")


def _reload_logits(model_dir: Path) -> torch.Tensor:
    import sys

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(EXAMPLES))
    from hf_tiny import probe_input_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(probe_input_ids()).logits


def _assert_complete_safetensors(model_dir: Path, base: Path) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(model_dir / "model.safetensors"))
    reference = load_file(str(base / "model.safetensors"))
    assert set(saved) == set(reference)
    for key, tensor in reference.items():
        assert saved[key].shape == tensor.shape, key
        assert saved[key].numel() > 0, key


def _assert_losses_match(run: dict, ref: dict, steps=range(1, 9)) -> None:
    for step in steps:
        assert rel_close(run["losses"][step], ref["losses"][step], RTOL), (step, run["losses"], ref["losses"])


def test_ddp_reference_learns(work):
    ddp = _ddp(work)
    assert ddp["world_size"] == 2
    assert sorted(ddp["losses"]) == list(range(1, 9))
    assert ddp["losses"][8] < ddp["losses"][1]


def test_zero2_without_use_cpu_matches_ddp_and_keeps_best_model(work):
    ddp = _ddp(work)
    z2 = _train(work, "zero2", "--deepspeed", str(INTEGRATIONS / "ds_config_zero2.json"),
                "--load_best_model_at_end", "--greater_is_better", "--zero_log_detail")
    assert z2["world_size"] == 2  # accelerate saw both ranks although use_cpu=False on a CPU-only machine
    _assert_losses_match(z2, ddp)
    for step, norm in ddp["grad_norms"].items():  # the global norm, before clipping
        assert rel_close(z2["grad_norms"][step], norm, RTOL), step

    # HfZeroCallback's additions to the logs in detail (--zero_log_detail), at every logging step
    for step in range(1, 9):
        logs = z2["zero_logs"][str(step)]
        assert 50 < logs["zero/peak_mem_mb/min"] <= logs["zero/peak_mem_mb/max"] < 100_000
        assert logs["zero/grad_norm"] == z2["grad_norms"][str(step)]
        assert logs["zero/loss_scale"] == 1.0 and logs["zero/skipped_steps"] == 0
        shares = [logs[f"zero/time_share/{phase}"] for phase in ("forward", "backward", "step")]
        assert all(0 < share < 1 for share in shares)
        assert abs(sum(shares) + logs["zero/time_share/other"] - 1.0) <= 2e-4  # the shares add up
        # time blocked in gradient reductions: inside backward's share, not part of the sum
        assert 0 < logs["zero/time_within/communication"] <= logs["zero/time_share/backward"]
    assert "zero/grad_norm" not in ddp["zero_logs"]["1"] and "zero/peak_mem_mb/max" in ddp["zero_logs"]["1"]
    # ... and its model card next to every saved model
    for directory in (z2["dir"] / "checkpoint-4", z2["dir"] / "final"):
        card = (directory / "README.md").read_text()
        for row in ("| ZeRO stage | 2 (optimizer states and gradients sharded) |", "| data-parallel processes | 2 |",
                    "| precision | fp32 |", "| batch | 2 per process x 2 accumulation steps x 2 processes = 8 "
                    "sequences per step |", "| gradient clipping | 1.0 |"):
            assert row in card, (row, card)
    assert "| optimizer steps | 4 |" in (z2["dir"] / "checkpoint-4" / "README.md").read_text()

    # the engine's checkpoint layout, as Trainer and DeepSpeed users expect it
    ckpt4 = z2["dir"] / "checkpoint-4"
    assert (ckpt4 / "latest").read_text().strip() == "global_step4"
    assert (ckpt4 / "global_step4").is_dir()
    assert not (ckpt4 / "optimizer.pt").exists()  # optimizer state lives in the engine checkpoint

    # weights at step 8 equal DDP's: the step-8 checkpoint's model reproduces DDP's final logits
    _assert_complete_safetensors(z2["dir"] / "checkpoint-8", work["base"])
    torch.testing.assert_close(_reload_logits(z2["dir"] / "checkpoint-8"), ddp["logits"], rtol=1e-4, atol=1e-4)

    # load_best_model_at_end with greater_is_better keeps the checkpoint with the higher eval loss: step 4
    assert z2["best_model_checkpoint"].endswith("checkpoint-4")
    final = z2["dir"] / "final"
    _assert_complete_safetensors(final, work["base"])
    reloaded = _reload_logits(final)
    torch.testing.assert_close(reloaded, z2["logits"], rtol=1e-5, atol=1e-5)  # saved == engine's weights
    torch.testing.assert_close(reloaded, _reload_logits(ckpt4), rtol=1e-5, atol=1e-5)  # == the best checkpoint
    assert not torch.allclose(reloaded, ddp["logits"], atol=1e-3)  # and not the step-8 weights


def test_zero2_resume_from_step_4_continues_the_same_curve(work):
    z2 = _train(work, "zero2", "--deepspeed", str(INTEGRATIONS / "ds_config_zero2.json"),
                "--load_best_model_at_end", "--greater_is_better", "--zero_log_detail")
    resumed = _train(work, "zero2_resumed", "--deepspeed", str(INTEGRATIONS / "ds_config_zero2.json"),
                     "--resume_from_checkpoint", str(z2["dir"] / "checkpoint-4"))
    assert resumed["global_step"] == 8
    for step in range(5, 9):
        assert rel_close(resumed["losses"][step], z2["losses"][step], 1e-5), (step, resumed["losses"], z2["losses"])
    # trained to the same step-8 weights as the uninterrupted run (and so as DDP)
    torch.testing.assert_close(resumed["logits"], _ddp(work)["logits"], rtol=1e-4, atol=1e-4)


def test_zero1_matches_ddp_and_stage0_resumes_its_checkpoint(work):
    ddp = _ddp(work)
    z1 = _train(work, "zero1", "--deepspeed", str(INTEGRATIONS / "ds_config_zero1.json"))
    _assert_losses_match(z1, ddp)
    stage0 = json.loads((INTEGRATIONS / "ds_config_zero1.json").read_text())
    stage0["zero_optimization"] = {"stage": 0}
    config0 = work["root"] / "ds_config_zero0.json"
    config0.write_text(json.dumps(stage0))
    # a stage-1 checkpoint (optimizer states sharded over 2 ranks) resumed by stage 0 (states whole on each rank)
    z0 = _train(work, "zero0_from_zero1", "--deepspeed", str(config0),
                "--resume_from_checkpoint", str(z1["dir"] / "checkpoint-4"))
    _assert_losses_match(z0, ddp)
    torch.testing.assert_close(z0["logits"], ddp["logits"], rtol=1e-4, atol=1e-4)


def _zero3(work):
    """ZeRO-3 with ``use_cpu=True``, compiled (``torch_compile_backend``): one run serves both tests below. The eager
    ZeRO-3 Trainer path is the offload runs' (and the README job's); eager == compiled bit for bit at the engine
    level is tests/test_zero3_compile.py's."""
    return _train(work, "zero3_compiled", "--deepspeed", str(INTEGRATIONS / "ds_config_zero3.json"), "--use_cpu",
                  "--torch_compile_backend", "aot_eager")


def test_zero3_with_use_cpu_from_pretrained_matches_ddp(work):
    ddp = _ddp(work)
    z3 = _zero3(work)
    assert z3["world_size"] == 2
    # from_pretrained partitioned the model as it loaded (no init_distributed call in the script): each rank holds
    # at most its half of the weights (small parameters may stay whole, as stage3_param_persistence_threshold says)
    at_load = z3["params_at_load"]
    assert at_load["full_numel"] == ddp["params_at_load"]["local_numel"] == ddp["params_at_load"]["full_numel"]
    assert at_load["local_numel"] <= at_load["full_numel"] / 2
    _assert_losses_match(z3, ddp)
    torch.testing.assert_close(z3["logits"], ddp["logits"], rtol=1e-4, atol=1e-4)
    assert (z3["dir"] / "checkpoint-4" / "global_step4").is_dir()
    final = z3["dir"] / "final"
    _assert_complete_safetensors(final, work["base"])
    torch.testing.assert_close(_reload_logits(final), z3["logits"], rtol=1e-5, atol=1e-5)


def test_zero3_with_torch_compile_matches_ddp(work):
    """``TrainingArguments(torch_compile_backend=...)`` under ZeRO-3: accelerate calls the engine's ``compile()`` (as
    it does DeepSpeed's); the ZeRO-3 hooks run between the compiled graphs, so the run trains as DDP does.
    aot_eager: dynamo and AOTAutograd in full (graph capture, the compiled backward) without inductor's C++ build
    time; inductor is covered by tests/test_zero3_compile.py."""
    ddp = _ddp(work)
    run = _zero3(work)
    assert run["compiled"] and not ddp["compiled"]
    assert run["dynamo_graphs"] > 0 and ddp["dynamo_graphs"] == 0
    _assert_losses_match(run, ddp)


def test_zero3_with_cpu_offload_matches_ddp(work):
    """Optimizer states and parameters offloaded (ds_config_zero3_offload.json: config AdamW, filled by "auto")."""
    ddp = _ddp(work)
    off = _train(work, "zero3_offload", "--deepspeed", str(INTEGRATIONS / "ds_config_zero3_offload.json"))
    _assert_losses_match(off, ddp)
    # the config optimizer decays the norm weights too (the Trainer's own AdamW exempts them): 1e-4 per step here
    torch.testing.assert_close(off["logits"], ddp["logits"], rtol=1e-3, atol=1e-3)
    _assert_complete_safetensors(off["dir"] / "final", work["base"])
    assert "| optimizer-state offload | cpu |" in (off["dir"] / "final" / "README.md").read_text()


def test_zero3_with_nvme_offload_matches_ddp(work):
    """ZeRO-Infinity through the Trainer: ds_config_zero3_nvme.json as shipped, with nvme_path pointed at a temporary
    directory. from_pretrained builds the model under zero.Init with that config, so the partitions are in swap
    files from the load on; the optimizer states are in swap files too."""
    ddp = _ddp(work)
    cfg = json.loads((INTEGRATIONS / "ds_config_zero3_nvme.json").read_text())
    nvme = work["root"] / "nvme"
    for key in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][key]["nvme_path"] = str(nvme)
    path = work["root"] / "ds_config_zero3_nvme.json"
    path.write_text(json.dumps(cfg))
    run = _train(work, "zero3_nvme", "--deepspeed", str(path))
    _assert_losses_match(run, ddp)
    # the config optimizer decays the norm weights too, as in the CPU-offload run above
    torch.testing.assert_close(run["logits"], ddp["logits"], rtol=1e-3, atol=1e-3)
    _assert_complete_safetensors(run["dir"] / "final", work["base"])
    card = (run["dir"] / "final" / "README.md").read_text()
    assert "| optimizer-state offload | nvme |" in card and "| parameter offload | nvme |" in card, card
    assert nvme.is_dir() and not list(nvme.glob("hf_zero-*")), list(nvme.iterdir())  # swap files removed at exit
