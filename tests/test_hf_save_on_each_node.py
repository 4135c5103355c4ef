"""``TrainingArguments(save_on_each_node=True)`` reaches the engine as ``checkpoint.use_node_local_storage`` (#26
item 7): transformers' DeepSpeed integration writes the key into the config it hands to ``deepspeed.initialize``,
which hf_zero answers, so every node then keeps its own complete checkpoint copy (tests/test_checkpoint_node_local.py
covers what the key does). DeepSpeed 0.19.8 reads the same key from the same config: its run of ``_both`` (1 CPU
rank, transformers' Trainer building the real DeepSpeed engine, scripts/ds_same_test.py) gives ``[True, False]``, the
value asserted here."""

from __future__ import annotations

import torch

from hf_zero.testing import run_distributed


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        x = (torch.arange(8) + i) % 64
        return {"input_ids": x, "labels": x}


def _run(out: str, save_on_each_node: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1, report_to=[], deepspeed=ds,
                             save_on_each_node=save_on_each_node, save_strategy="no", disable_tqdm=True,
                             dataloader_pin_memory=False)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    trainer = Trainer(model=LlamaForCausalLM(cfg), args=args, train_dataset=_Data())
    trainer.train()
    return trainer.model_wrapped.use_node_local_storage()


def _both(out: str):
    return [_run(f"{out}/a", True), _run(f"{out}/b", False)]


def test_save_on_each_node_turns_on_node_local_checkpoints(tmp_path):
    assert run_distributed(_both, 1, args=(str(tmp_path),), timeout_s=180)[0] == [True, False]
