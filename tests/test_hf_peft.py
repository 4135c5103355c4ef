"""PEFT LoRA with the HF ``Trainer`` on hf_zero: ``examples/lora_train.py`` under ``torchrun``, 2 CPU processes.

Reference: the same script under plain DDP. Checked for ZeRO-3 (ZeRO-2 runs the same code path minus the
parameter partitioning):
- the losses equal DDP's, and the saved ``adapter_model.safetensors`` equals DDP's adapter within 1e-2 relative,
  every LoRA tensor present with its real 2-D shape (ZeRO-3 users get 0-element or missing tensors elsewhere);
- the frozen base weights have no gradient, and the optimizer holds only this rank's shard of the LoRA weights;
- ``merge_and_unload()`` inside ``GatheredParameters`` gives weights whose logits equal the adapted model's;
- ZeRO-3: resuming from the step-4 checkpoint (``load_module_strict=False``) continues the same loss curve;
- QLoRA (bitsandbytes 4-bit base, which runs on this CPU) under ZeRO-3 equals QLoRA under DDP.
"""

from __future__ import annotations

import json

import pytest
import torch

from _hf_env import EXAMPLES, INTEGRATIONS, make_venv, rel_close, tiny_base_model, torchrun

SCRIPT = EXAMPLES / "lora_train.py"
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK_R = 8
# tiny Llama: hidden 64, 2 key/value heads of 16. Not 32: bitsandbytes >= 0.50 repacks 4-bit weights for its CPU
# kernel in eval mode and needs every in_features to be a multiple of its 64-element quantization block.
HIDDEN, KV = 64, 32


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_peft")
    return {"root": root, "python": make_venv(root / "venv"), "base": tiny_base_model(root / "base", hidden_size=HIDDEN), "runs": {}}


def _train(work: dict, name: str, *args: str) -> dict:
    if name not in work["runs"]:
        out, metrics = work["root"] / name, work["root"] / f"{name}.json"
        torchrun(work["python"], SCRIPT, ["--model_name_or_path", str(work["base"]), "--output_dir", str(out),
                                          "--max_steps", "8", "--save_steps", "4", "--metrics_out", str(metrics),
                                          *args], cwd=work["root"])
        result = json.loads(metrics.read_text())
        result["losses"] = {int(k): v for k, v in result["losses"].items()}
        result["merged_logits"] = torch.load(str(metrics) + ".merged_logits.pt")
        result["dir"] = out
        work["runs"][name] = result
    return work["runs"][name]


def _adapter(run: dict, sub: str = "final") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run["dir"] / sub / "adapter_model.safetensors"))


def _expected_shape(key: str) -> tuple[int, int]:
    out = KV if ("k_proj" in key or "v_proj" in key) else HIDDEN
    return (RANK_R, HIDDEN) if "lora_A" in key else (out, RANK_R)


def _check_against_ddp(run: dict, ddp: dict) -> None:
    for step in range(1, 9):
        assert rel_close(run["losses"][step], ddp["losses"][step], 1e-3), (step, run["losses"], ddp["losses"])
    adapter, reference = _adapter(run), _adapter(ddp)
    assert set(adapter) == set(reference)
    assert len(adapter) == 2 * 2 * len(LORA_MODULES)  # 2 layers x (A, B) x 4 projections
    for key, ref in reference.items():
        assert adapter[key].shape == ref.shape == _expected_shape(key), key
        assert ref.abs().max() > 0, key  # trained values, not zeros
        err = (adapter[key].float() - ref.float()).norm() / ref.float().norm()
        assert err < 1e-2, (key, err.item())


def _check_memory(run: dict) -> None:
    mem = run["memory"]
    assert mem["frozen_with_grad"] == 0
    assert mem["trainable"] == 2 * len(LORA_MODULES) * RANK_R * 2 * HIDDEN - 2 * 2 * RANK_R * (HIDDEN - KV)
    # this rank's master copy is its 1/world share of the LoRA weights (up to shard padding), nothing of the base
    assert mem["trainable"] / mem["world_size"] <= mem["optimizer_params"] <= mem["trainable"] / 2 + 2 * 64
    assert mem["optimizer_state"] == 2 * mem["optimizer_params"]  # Adam: exp_avg + exp_avg_sq


def _check_merge(run: dict) -> None:
    torch.testing.assert_close(run["merged_logits"], torch.tensor(run["peft_logits"]), rtol=1e-4, atol=1e-4)


def test_lora_ddp_reference(work):
    ddp = _train(work, "ddp", "--use_cpu")
    assert ddp["memory"]["optimizer_params"] == ddp["memory"]["trainable"]  # DDP: full copy on every rank
    _check_merge(ddp)


def test_lora_zero3_adapter_complete_and_matches_ddp(work):
    ddp = _train(work, "ddp", "--use_cpu")
    z3 = _train(work, "zero3", "--deepspeed", str(INTEGRATIONS / "ds_config_zero3.json"))
    _check_against_ddp(z3, ddp)
    _check_memory(z3)
    _check_merge(z3)
    assert (z3["dir"] / "checkpoint-4" / "adapter_model.safetensors").is_file()


def test_lora_zero3_resume_continues_the_same_curve(work):
    z3 = _train(work, "zero3", "--deepspeed", str(INTEGRATIONS / "ds_config_zero3.json"))
    resumed = _train(work, "zero3_resumed", "--deepspeed", str(INTEGRATIONS / "ds_config_zero3.json"),
                     "--resume_from_checkpoint", str(z3["dir"] / "checkpoint-4"))
    for step in range(5, 9):
        assert rel_close(resumed["losses"][step], z3["losses"][step], 1e-5), (step, resumed["losses"], z3["losses"])
    for key, tensor in _adapter(z3).items():
        torch.testing.assert_close(_adapter(resumed)[key], tensor, rtol=1e-5, atol=1e-6)


def test_qlora_4bit_base_zero3_matches_ddp(work):
    pytest.importorskip("bitsandbytes")
    ddp = _train(work, "qlora_ddp", "--use_cpu", "--load_in_4bit")
    z3 = _train(work, "qlora_zero3", "--deepspeed", str(INTEGRATIONS / "ds_config_zero3.json"), "--load_in_4bit")
    _check_against_ddp(z3, ddp)
    mem = z3["memory"]
    assert mem["frozen_with_grad"] == 0
    assert mem["optimizer_params"] <= mem["trainable"] / 2 + 2 * 64 and mem["optimizer_state"] == 2 * mem[
        "optimizer_params"]
    # merging into a 4-bit base re-quantizes the merged weights: equal up to the 4-bit rounding of this tiny model
    for run in (ddp, z3):
        peft_logits = torch.tensor(run["peft_logits"])
        assert (run["merged_logits"] - peft_logits).abs().max() < 0.25 * peft_logits.abs().max()
    torch.testing.assert_close(z3["merged_logits"], ddp["merged_logits"], rtol=1e-3, atol=1e-3)
