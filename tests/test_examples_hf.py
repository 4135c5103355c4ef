"""The README's main job, as written there: ``torchrun --nproc_per_node 2 examples/train_trainer.py --deepspeed
integrations/ds_config_zero3.json`` (model built from its config under ZeRO-3, no ``use_cpu``), shortened to 4 steps.

The Trainer, accelerate and LoRA examples are otherwise exercised with their parity checks by ``test_hf_trainer.py``,
``test_hf_accelerate.py`` and ``test_hf_peft.py``.
"""

from __future__ import annotations

import json
import math
import sys

import torch

from _hf_env import EXAMPLES, REPO, make_venv, torchrun


def test_readme_main_job_zero3_from_config(tmp_path):
    python = make_venv(tmp_path / "venv")
    metrics = tmp_path / "metrics.json"
    out = tmp_path / "out"
    torchrun(python, EXAMPLES / "train_trainer.py",
             ["--deepspeed", "integrations/ds_config_zero3.json", "--output_dir", str(out), "--max_steps", "4",
              "--save_steps", "4", "--metrics_out", str(metrics)], cwd=REPO)
    result = json.loads(metrics.read_text())
    assert result["world_size"] == 2 and result["global_step"] == 4
    assert sorted(map(int, result["losses"])) == [1, 2, 3, 4]
    assert all(math.isfinite(v) and 3.0 < v < 6.0 for v in result["losses"].values())  # ~ln(128) at the start
    # built under zero.Init by from_config: partitioned from the start
    assert result["params_at_load"]["local_numel"] <= result["params_at_load"]["full_numel"] / 2
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(EXAMPLES))
    from hf_tiny import probe_input_ids

    saved = load_file(str(out / "final" / "model.safetensors"))
    assert all(t.numel() > 0 for t in saved.values()) and len(saved) == 2 + 2 * 9 + 1  # embed, head, norm, layers
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    with torch.no_grad():
        reloaded = model(probe_input_ids()).logits
    torch.testing.assert_close(reloaded, torch.load(str(metrics) + ".logits.pt"), rtol=1e-5, atol=1e-5)
    card = (out / "final" / "README.md").read_text()
    assert "| ZeRO stage | 3 (optimizer states, gradients and parameters sharded) |" in card
