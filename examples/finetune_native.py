"""Fine-tune a small Llama (built from config, no download) with hf_zero's native API on 1..N CPU processes.

    torchrun --nproc_per_node 2 examples/finetune_native.py --stage 2 --steps 30

The data is local and generated: arithmetic lines ("17+25=42") as bytes, so a 256-token byte vocabulary needs no
tokenizer. The loop is DeepSpeed's, with one import changed: engine(batch) / engine.backward(loss) / engine.step().
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_zero


def arithmetic_corpus(n_lines: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"{a}+{b}={a + b}\n")
    return "".join(lines).encode()


def batches(data: torch.Tensor, seq_len: int, micro_batch: int, rank: int, world: int, seed: int):
    """Random windows of the byte stream; each rank draws its own (disjoint seeds), as a sharded sampler would."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        starts = torch.randint(0, data.numel() - seq_len - 1, (micro_batch,), generator=g)
        yield torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=30)
    # the `deepspeed` launcher passes --local_rank to every script (as DeepSpeed's does); the engine reads
    # LOCAL_RANK from the environment itself
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="fp32 is the fast choice on CPUs without native bf16 (AVX512-BF16/AMX)")
    parser.add_argument("--output", default="out/finetune_native")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": args.steps,
                                                          "warmup_max_lr": 3e-3}},
        "zero_optimization": {"stage": args.stage, "overlap_comm": True},
        "steps_per_print": 10,
    }
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128))
    engine, optimizer, _, scheduler = hf_zero.initialize(model=model, config=config)
    rank, world = hf_zero.comm.get_rank(), hf_zero.comm.get_world_size()
    data = torch.tensor(list(arithmetic_corpus(20_000)), dtype=torch.long)
    stream = batches(data, seq_len=64, micro_batch=engine.train_micro_batch_size_per_gpu(), rank=rank,
                     world=world, seed=1)
    history = []
    start = time.perf_counter()
    while engine.global_steps < args.steps:
        ids = next(stream).to(engine.device)  # the engine trains on its device (cuda:LOCAL_RANK or the CPU)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            history.append(loss.item())
        engine.step()
    seconds = time.perf_counter() - start
    engine.save_checkpoint(os.path.join(args.output, "checkpoints"))
    engine.save_16bit_model(args.output)
    if rank == 0:
        first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
        summary = {"world_size": world, "stage": args.stage, "steps": engine.global_steps,
                   "loss_first3": round(first, 4), "loss_last3": round(last, 4),
                   "seconds_per_step": round(seconds / args.steps, 3), "grad_norm": engine.get_global_grad_norm()}
        print(json.dumps(summary))
        if not last < first:
            raise SystemExit(f"loss did not go down: {first:.4f} -> {last:.4f}")
    hf_zero.comm.barrier()


if __name__ == "__main__":
    main()
