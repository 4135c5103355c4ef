"""The tiny model and data the Hugging Face examples train on, so every example runs on a laptop CPU in minutes.

- :func:`tiny_llama_config`: a 2-layer Llama built from its config class (nothing is downloaded).
- :func:`synthetic_lm_dataset`: token sequences from a small family of affine recurrences
  ``x[t+1] = (a * x[t] + b) mod V``. A model can learn them, so the loss visibly falls within a few steps, and the
  data is regenerated bit-identically from a seed on every rank and every run (what the parity tests rely on).

Replace both with your own model name and dataset to fine-tune something real.
"""

from __future__ import annotations

import torch

__all__ = ["VOCAB_SIZE", "SEQ_LEN", "tiny_llama_config", "synthetic_lm_dataset", "probe_input_ids"]

VOCAB_SIZE = 128
SEQ_LEN = 32


def tiny_llama_config(hidden_size: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager")


class _TokenDataset(torch.utils.data.Dataset):
    """``input_ids``/``labels`` rows of one (N, SEQ_LEN) int64 tensor; the model shifts labels itself."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids  # (N, T)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def synthetic_lm_dataset(num_samples: int = 256, seed: int = 0) -> _TokenDataset:
    g = torch.Generator().manual_seed(seed)
    usable = VOCAB_SIZE - 3  # ids 0-2 are pad/bos/eos
    a = torch.tensor([1, 3, 5, 7])[torch.randint(0, 4, (num_samples, 1), generator=g)]  # (N, 1)
    b = torch.randint(1, 8, (num_samples, 1), generator=g)  # (N, 1)
    x = torch.empty(num_samples, SEQ_LEN, dtype=torch.long)
    x[:, 0] = torch.randint(0, usable, (num_samples,), generator=g)
    for t in range(1, SEQ_LEN):
        x[:, t] = (a[:, 0] * x[:, t - 1] + b[:, 0]) % usable
    return _TokenDataset(x + 3)


def probe_input_ids(batch: int = 2) -> torch.Tensor:
    """A fixed (batch, SEQ_LEN) input for comparing the logits of two copies of a model."""
    return synthetic_lm_dataset(batch, seed=1234).ids
