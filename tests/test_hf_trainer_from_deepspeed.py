"""A Trainer job that ran on DeepSpeed resumes on hf_zero from DeepSpeed's checkpoint, unchanged.

``tests/data/deepspeed_checkpoints/trainer_zero2/checkpoint-4`` is what DeepSpeed 0.19.8 and transformers wrote at
step 4 of ``examples/train_trainer.py`` (ZeRO-2, 2 CPU ranks; the command is in ``deepspeed_run.json`` beside it,
with DeepSpeed's logged losses of all 8 steps). The same script, with hf_zero answering ``import deepspeed``,
resumes from it (``--resume_from_checkpoint``): steps 5-8 must give DeepSpeed's losses -- at ZeRO-2 as DeepSpeed
ran, and at ZeRO-3 (the checkpoint re-cut on load).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _hf_env import EXAMPLES, INTEGRATIONS, make_venv, rel_close, tiny_base_model, torchrun

FIXTURE = Path(__file__).parent / "data" / "deepspeed_checkpoints" / "trainer_zero2"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trainer_from_ds")
    shutil.copytree(FIXTURE / "checkpoint-4", root / "ds_run" / "checkpoint-4")  # the test never writes into data/
    return {"root": root, "python": make_venv(root / "venv"), "base": tiny_base_model(root / "base"),
            "ds": {int(k): v for k, v in json.loads((FIXTURE / "deepspeed_run.json").read_text())["losses"].items()}}


@pytest.mark.parametrize("config", ["ds_config_zero2.json", "ds_config_zero3.json"])
def test_trainer_resumes_deepspeeds_checkpoint_on_its_loss_curve(work, config):
    metrics = work["root"] / f"{config}.json"
    out = torchrun(work["python"], EXAMPLES / "train_trainer.py",
                   ["--deepspeed", str(INTEGRATIONS / config), "--use_cpu", "--model_name_or_path", str(work["base"]),
                    "--output_dir", str(work["root"] / config), "--max_steps", "8", "--save_steps", "4",
                    "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                    "--resume_from_checkpoint", str(work["root"] / "ds_run" / "checkpoint-4"),
                    "--metrics_out", str(metrics)], cwd=work["root"])
    assert "loading DeepSpeed 0.19.8 checkpoint" in out and "(ZeRO stage 2, 2 ranks)" in out
    losses = {int(k): v for k, v in json.loads(metrics.read_text())["losses"].items()}
    # steps 1-4: DeepSpeed's log, restored from trainer_state.json; 5-8: trained here
    assert sorted(losses) == list(range(1, 9))
    assert all(losses[step] == work["ds"][step] for step in range(1, 5))
    for step in range(5, 9):
        assert rel_close(losses[step], work["ds"][step], 1e-4), (step, losses[step], work["ds"][step])
    assert out.count("'loss'") == 4 * 2 or out.count("'loss'") == 4  # four steps logged (per rank or rank 0)
