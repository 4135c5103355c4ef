"""Shared by the compression examples and benchmarks/bench_compression.py: the shipped corpus as byte tokens,
a small Llama built from config, and Trainer runs on CPU.

The "fine-tuned here" base model: a byte-level Llama trained from scratch on examples/data/synthetic_train.txt
(written by examples/data/make_corpus.py). Nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

DATA = Path(__file__).parent / "data"
VOCAB = 128  # ASCII bytes


def token_blocks(split: str, block: int = 128) -> torch.Tensor:
    """(N, block) int64 byte ids of ``synthetic_{split}.txt`` ("train" or "heldout"), cut into full blocks."""
    data = (DATA / f"synthetic_{split}.txt").read_bytes()
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n = ids.numel() // block
    return ids[: n * block].view(n, block)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def small_llama(hidden: int = 128, layers: int = 4, intermediate: int | None = None, heads: int | None = None,
                seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    heads = heads or max(1, hidden // 64)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    return LlamaForCausalLM(cfg)


def train(model, steps: int, out_dir: str, *, lr: float = 2e-3, batch: int = 16, trainer_cls=Trainer,
          callbacks=(), warmup: int | None = None, **trainer_kwargs: Any):
    """Trainer run on CPU over the training blocks; returns the Trainer."""
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch,
                             learning_rate=lr, lr_scheduler_type="cosine",
                             warmup_steps=warmup if warmup is not None else max(1, steps // 20),
                             weight_decay=0.01, logging_steps=max(1, steps // 10), save_strategy="no",
                             report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    trainer = trainer_cls(model=model, args=args, train_dataset=Blocks(token_blocks("train")),
                          callbacks=list(callbacks), **trainer_kwargs)
    trainer.train()
    return trainer


def base_model(path: str, *, hidden: int = 128, layers: int = 4, intermediate: int | None = None,
               steps: int = 300, lr: float = 2e-3, batch: int = 16) -> LlamaForCausalLM:
    """The fine-tuned base: loaded from ``path`` when present, else trained and saved there."""
    if os.path.exists(os.path.join(path, "config.json")):
        return LlamaForCausalLM.from_pretrained(path).eval()
    model = small_llama(hidden, layers, intermediate)
    train(model, steps, os.path.join(path, "_trainer"), lr=lr, batch=batch)
    model.save_pretrained(path)
    return model.eval()
