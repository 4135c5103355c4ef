"""``accelerate launch --config_file integrations/accelerate_zero{2,3}_cpu.yaml`` of a custom loop, on hf_zero.

The environment has no real DeepSpeed (checked: ``pip list`` shows none, and with
``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1`` ``import deepspeed`` fails as usual). The launched script is
``examples/accelerate_train.py``: a plain ``Accelerator()`` on a CPU-only machine, 2 processes. Each rank must see
``num_processes == 2`` and its own share of the data, and the losses must equal a single-process replay of the
same global batches (the union of both ranks' samples each step) with torch's AdamW and gradient clipping.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from _hf_env import (DISABLE, EXAMPLES, INTEGRATIONS, accelerate_launch, clean_env, make_venv, rel_close,
                     tiny_base_model)

STEPS = 6
LR = 1e-2


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_accelerate")
    return {"root": root, "python": make_venv(root / "venv"), "base": tiny_base_model(root / "base")}


def test_environment_has_no_real_deepspeed(env):
    listed = subprocess.run([str(env["python"]), "-m", "pip", "list", "--format", "json"], capture_output=True,
                            text=True, timeout=120, env=clean_env())
    assert listed.returncode == 0, listed.stderr
    names = {d["name"].lower() for d in json.loads(listed.stdout)}
    assert "torch" in names and "accelerate" in names and "deepspeed" not in names
    check = "import deepspeed, importlib.metadata as m; print(m.version('deepspeed'))"
    shim = subprocess.run([str(env["python"]), "-c", check], capture_output=True, text=True, timeout=120,
                          env=clean_env())
    assert shim.returncode == 0 and "+hfzero" in shim.stdout, shim.stderr
    off = subprocess.run([str(env["python"]), "-c", check], capture_output=True, text=True, timeout=120,
                         env=clean_env(**{DISABLE: "1"}))
    assert off.returncode != 0 and "No module named 'deepspeed'" in off.stderr


def _replay(base, records: list[dict]) -> list[float]:
    """Single-process training on the same global batches: per-rank mean losses averaged, as 2 ranks compute."""
    sys.path.insert(0, str(EXAMPLES))
    from hf_tiny import synthetic_lm_dataset
    from transformers import AutoModelForCausalLM

    data = synthetic_lm_dataset(256, seed=0).ids
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        rank_losses = [model(input_ids=data[r["indices"][step]], labels=data[r["indices"][step]]).loss
                       for r in records]
        loss = torch.stack(rank_losses).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_launch_custom_loop_shards_data_and_matches_reference(env, stage):
    root = env["root"] / f"zero{stage}"
    root.mkdir()
    record = root / "record"
    out = root / "model"
    config = INTEGRATIONS / f"accelerate_zero{stage}_cpu.yaml"
    accelerate_launch(env["python"], config, EXAMPLES / "accelerate_train.py",
                      ["--model_name_or_path", str(env["base"]), "--steps", str(STEPS), "--learning_rate", str(LR),
                       "--record", str(record), "--output_dir", str(out)], cwd=root)
    records = [json.loads((root / f"record.rank{r}.json").read_text()) for r in range(2)]
    for rank, rec in enumerate(records):
        assert rec["num_processes"] == 2 and rec["process_index"] == rank
        assert rec["distributed_type"] == "DistributedType.DEEPSPEED"
        assert rec["engine"] == "HfZeroEngine" and rec["zero_stage"] == stage
    # different batches on the two ranks, each step, and no sample twice within the run
    seen = [i for rec in records for batch in rec["indices"] for i in batch]
    assert len(seen) == len(set(seen)) == 2 * 2 * STEPS
    assert records[0]["losses"] == records[1]["losses"]

    expected, reference = _replay(env["base"], records)
    for step, (got, want) in enumerate(zip(records[0]["losses"], expected)):
        assert rel_close(got, want, 1e-3), (step, records[0]["losses"], expected)

    # accelerator.save_model wrote the trained weights, equal to the replay's
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    for name, param in reference.named_parameters():
        torch.testing.assert_close(saved[name], param.detach(), rtol=1e-3, atol=1e-4)
