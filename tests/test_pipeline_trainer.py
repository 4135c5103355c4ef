"""PipelineTrainer: the HF Trainer drives an unmodified tiny Llama cut into 2 stages; its logged losses and the
save_model directory equal the unsplit model trained on the same batches (SGD, clipping 1.0, constant LR)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_zero.testing import run_distributed

from test_pipeline_hf import CLIP, LR, make_model

ROWS, M, STEPS, SEQ, VOCAB = 4, 2, 3, 8, 64


def _dataset():
    g = torch.Generator().manual_seed(11)
    rows = []
    for _ in range(ROWS * STEPS):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        n = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        mask = (torch.arange(SEQ) < n).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def _train(out_dir: str):
    from transformers import TrainingArguments

    from hf_zero.integrations.pipeline_trainer import PipelineTrainer
    from hf_zero.pipeline import wrap

    pipe = wrap(make_model("llama"), num_stages=2)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=ROWS, max_steps=STEPS,
                             learning_rate=LR, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                             report_to=[], max_grad_norm=CLIP, seed=42, use_cpu=True)
    cfg = {"gradient_accumulation_steps": M, "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "pipeline": {"schedule": "1f1b"}, "steps_per_print": 1000}
    trainer = PipelineTrainer(model=pipe, args=args, train_dataset=_dataset(), hf_zero_config=cfg)
    trainer.train()
    trainer.save_model(out_dir + "/final")
    return [(h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h]


def test_trainer_drives_the_pipeline_like_the_unsplit_model(tmp_path):
    from transformers import LlamaForCausalLM

    logs = run_distributed(_train, world_size=2, args=(str(tmp_path),), timeout_s=400)
    data = _dataset()
    order = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=42))
    model = make_model("llama")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref = []
    for s in range(STEPS):
        rows = [data[i] for i in order[s * ROWS:(s + 1) * ROWS]]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        loss = model(**batch).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        opt.zero_grad()
        ref.append((loss.item(), norm))
    for rank_logs in logs:
        assert [l for l, _ in rank_logs] == pytest.approx([l for l, _ in ref], abs=1e-4)  # the Trainer rounds to 4
        assert [n for _, n in rank_logs] == pytest.approx([n for _, n in ref], rel=1e-5)
    saved = LlamaForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=2e-6, msg=key)
    assert json.loads((tmp_path / "final" / "config.json").read_text())["num_hidden_layers"] == 4
