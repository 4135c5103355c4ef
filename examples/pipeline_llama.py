"""Train an unmodified Hugging Face Llama with pipeline stages x data-parallel replicas on CPU processes.

    torchrun --nproc_per_node 4 examples/pipeline_llama.py --stages 2 --zero 1 --steps 30

The model is a small LlamaForCausalLM built from its config (no download); every rank builds the same one, and
``hf_zero.pipeline.wrap`` keeps only this rank's stage. Data: arithmetic lines ("17+25=42") as bytes (a 256-token
byte vocabulary, no tokenizer), right-padded to a fixed length with an attention mask, so padding is exercised.
Each replica reads its own micro-batches; both stages of a replica read the same ones (the last stage needs the
labels, every stage the mask). At the end the pipeline saves an ordinary ``save_pretrained`` directory.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import hf_zero
from hf_zero.pipeline import wrap


def micro_batches(seq_len: int, micro: int, replica: int, seed: int):
    """Endless padded micro-batches of arithmetic lines; replica r draws from its own stream."""
    rng = random.Random(seed * 1000 + replica)
    while True:
        ids = torch.zeros(micro, seq_len, dtype=torch.long)
        mask = torch.zeros(micro, seq_len, dtype=torch.long)
        for row in range(micro):
            text = b""
            while True:
                a, b = rng.randint(0, 99), rng.randint(0, 99)
                line = f"{a}+{b}={a + b}\n".encode()
                if len(text) + len(line) > seq_len:
                    break
                text += line
            ids[row, :len(text)] = torch.tensor(list(text))
            mask[row, :len(text)] = 1
        yield {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved_1f1b"])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--output", default="pipeline_llama_out")
    args = parser.parse_args()

    hf_zero.init_distributed()
    torch.manual_seed(0)  # the same initial model on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=True)
    virtual = 2 if args.schedule == "interleaved_1f1b" else 1
    pipe = wrap(LlamaForCausalLM(config), num_stages=args.stages, virtual_stages=virtual)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.micro_batches,
        "gradient_clipping": 1.0, "steps_per_print": 10,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": args.zero},
        "pipeline": {"schedule": args.schedule, "virtual_stages": virtual},
    }
    engine, *_ = hf_zero.initialize(model=pipe, config=ds_config)
    data = micro_batches(args.seq_len, args.micro, engine.grid.data_parallel_id, seed=1)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        loss = engine.train_batch(data)
        losses.append(round(loss.item(), 4))
    elapsed = time.perf_counter() - start
    pipe.save_pretrained(args.output)
    if dist.get_rank() == 0:
        print(json.dumps({"stages": args.stages, "replicas": engine.grid.data_parallel_size, "zero": args.zero,
                          "schedule": args.schedule, "first_loss": losses[0], "last_loss": losses[-1],
                          "seconds_per_step": round(elapsed / args.steps, 3), "saved": args.output}))
    engine.destroy()


if __name__ == "__main__":
    main()
