"""Compression benchmark: a small byte-level Llama trained here on the shipped synthetic corpus, then
(1) int8 (weights per channel + dynamic 8-bit activations, PyTorch x86 kernels), (2) 50% structured pruning
(MLP rows and attention heads) with a short recovery fine-tune, cleaned, (3) a half-depth student initialized from
teacher layers and distilled -- against the same student trained without a teacher.

Reports size on disk, size of linear weights, CPU latency (one thread, interleaved timing) and held-out
perplexity, as ratios against the baseline, and writes the table as a model card.

    python benchmarks/bench_compression.py    # the reported run: ~1 h wall on a 2-core machine shared 5 ways
    python benchmarks/bench_compression.py --hidden 64 --steps 20 --recovery-steps 5 --distill-steps 5  # smoke

Targets (issue 8): int8 >= 3.5x smaller linear weights, >= 1.5x faster, <= 2% perplexity increase; pruning >= 1.3x
faster with <= 10% perplexity increase; the distilled student beats the same student trained without a teacher.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from compress_common import base_model, small_llama, token_blocks, train  # noqa: E402

from hf_zero.compression import (CompressionCallback, DistillationTrainer, export_int8, init_compression,  # noqa: E402
                                 make_student)
from hf_zero.compression.export import linear_weight_nbytes  # noqa: E402
from hf_zero.compression.measure import cpu_latency, perplexity, size_on_disk  # noqa: E402
from hf_zero.compression.model_card import Measurement, render_model_card  # noqa: E402

def prune_config(recovery_steps: int) -> dict:
    """50% of MLP rows and of attention heads, l1, ramped (cubic) over the first half of the recovery fine-tune."""
    ramp = {"schedule_offset": 0, "schedule_offset_end": recovery_steps // 2,
            "schedule_offset_stride": max(1, recovery_steps // 20)}
    return {"compression_training": {
        "row_pruning": {"shared_parameters": {"enabled": True, "method": "l1", **ramp},
                        "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["mlp.up_proj"],
                                                     "related_modules": [["mlp.gate_proj", "mlp.down_proj"]]}}},
        "head_pruning": {"shared_parameters": {"enabled": True, "method": "l1", **ramp},
                         "different_groups": {"hp1": {"params": {"dense_ratio": 0.5},
                                                      "modules": ["self_attn.o_proj"],
                                                      "related_modules": [["self_attn.q_proj", "self_attn.k_proj",
                                                                           "self_attn.v_proj"]]}}},
    }}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="baseline training steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--recovery-steps", type=int, default=100)
    p.add_argument("--distill-steps", type=int, default=80)
    p.add_argument("--kd-temperature", type=float, default=1.0)
    p.add_argument("--kd-alpha", type=float, default=0.5, help="weight of the teacher term (1 - alpha: labels)")
    p.add_argument("--kd-hidden-weight", type=float, default=0.1, help="weight of the hidden-state MSE")
    p.add_argument("--train-threads", type=int, default=2)
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "hf_zero_bench_compression"))
    p.add_argument("--card", default=str(ROOT / "model_cards" / "compressed_model.md"))
    p.add_argument("--json", default=None, help="also write the measurements here")
    a = p.parse_args()
    os.makedirs(a.work_dir, exist_ok=True)
    torch.set_num_threads(a.train_threads)
    t0 = time.time()
    base_dir = os.path.join(a.work_dir, f"base_h{a.hidden}_l{a.layers}_s{a.steps}")
    if not os.path.exists(os.path.join(base_dir, "config.json")):
        model = small_llama(a.hidden, a.layers, heads=a.heads)
        train(model, a.steps, os.path.join(base_dir, "_trainer"), batch=a.batch, lr=2e-3)
        model.save_pretrained(base_dir)
    base = base_model(base_dir).eval()
    print(f"[{time.time() - t0:.0f}s] baseline ready", flush=True)

    # (1) int8: post-training, no data needed
    int8 = export_int8(copy.deepcopy(base))

    # (2) 50% of MLP rows and of heads, ramped in during a short recovery fine-tune, cleaned at the end
    prune = prune_config(a.recovery_steps)
    pruned = init_compression(copy.deepcopy(base).train(), prune)
    train(pruned, a.recovery_steps, os.path.join(a.work_dir, "_prune"), batch=a.batch, lr=1e-3,
          callbacks=[CompressionCallback(prune, clean_at_end=True)])
    pruned.eval()
    print(f"[{time.time() - t0:.0f}s] pruned + cleaned: {pruned.config.intermediate_size} MLP rows, "
          f"{pruned.config.num_attention_heads} heads", flush=True)

    # (3) half-depth student from teacher layers: distilled vs the same student trained without a teacher
    keep = max(1, a.layers // 2)
    distilled = make_student(base, keep).train()
    train(distilled, a.distill_steps, os.path.join(a.work_dir, "_kd"), batch=a.batch, lr=1e-3,
          trainer_cls=DistillationTrainer, teacher_model=base, temperature=a.kd_temperature, alpha=a.kd_alpha,
          hidden_weight=a.kd_hidden_weight)
    no_teacher = make_student(base, keep).train()
    train(no_teacher, a.distill_steps, os.path.join(a.work_dir, "_ce"), batch=a.batch, lr=1e-3)
    print(f"[{time.time() - t0:.0f}s] students trained", flush=True)

    torch.set_num_threads(1)
    held = token_blocks("heldout")
    latency_ids = held[:4]
    variants = [("baseline (fp32)", base), ("int8 (PTQ, dynamic activations)", int8),
                ("50% rows+heads pruned, recovered, cleaned", pruned),
                (f"distilled student ({keep}/{a.layers} layers)", distilled),
                (f"same student, no teacher ({keep}/{a.layers} layers)", no_teacher)]
    latencies = cpu_latency([m for _, m in variants], latency_ids, repeats=15)
    rows = []
    for (name, model), lat in zip(variants, latencies):
        rows.append(Measurement(name=name, size_bytes=size_on_disk(model), latency_s=lat,
                                perplexity=perplexity(model, held), linear_nbytes=linear_weight_nbytes(model)))
    b, q, pr, kd, ce = rows
    checks = {
        "int8 linear weights >= 3.5x smaller": b.linear_nbytes / q.linear_nbytes >= 3.5,
        "int8 >= 1.5x faster": b.latency_s / q.latency_s >= 1.5,
        "int8 perplexity <= +2%": q.perplexity / b.perplexity - 1 <= 0.02,
        "pruned >= 1.3x faster": b.latency_s / pr.latency_s >= 1.3,
        "pruned perplexity <= +10%": pr.perplexity / b.perplexity - 1 <= 0.10,
        "distilled student beats no-teacher student": kd.perplexity < ce.perplexity,
    }
    n_params = sum(p.numel() for p in base.parameters())
    card = render_model_card(
        title="hf_zero compression benchmark: small byte-level Llama",
        base_model=f"Llama from config (hidden {a.hidden}, {a.layers} layers, {a.heads} heads, "
                   f"{n_params / 1e6:.1f}M parameters, byte vocabulary) trained {a.steps} steps on "
                   f"examples/data/synthetic_train.txt",
        steps=["int8: `export_int8` on the trained model (per-output-channel symmetric int8 weights; inputs "
               "quantized to 8 bits dynamically per tensor by PyTorch's x86 kernels)",
               f"pruning: `init_compression` with row_pruning (MLP up/gate rows, down columns) and head_pruning, "
               f"dense_ratio 0.5 each, l1, ramped in over the first {a.recovery_steps // 2} of {a.recovery_steps} "
               f"recovery steps with "
               f"`CompressionCallback(clean_at_end=True)` (`redundancy_clean` removed the rows and heads)",
               f"distillation: `make_student` copied teacher layers {list(range(a.layers))[1::2] or [0]} into a "
               f"{keep}-layer student, trained {a.distill_steps} steps with `DistillationTrainer` "
               f"(T={a.kd_temperature}, alpha={a.kd_alpha}, hidden-state weight {a.kd_hidden_weight}); the comparison "
               f"student had the same initialization and steps, no teacher"],
        results=rows, compression_config=prune,
        eval_data=f"{held.shape[0]} held-out blocks of {held.shape[1]} bytes (examples/data/synthetic_heldout.txt)",
        latency_setup=f"median forward time of a ({latency_ids.shape[0]}, {latency_ids.shape[1]}) batch, "
                      f"1 CPU thread, {torch.backends.cpu.get_cpu_capability()}, models timed interleaved",
        notes=[f"target {k}: {'met' if v else 'MISSED'}" for k, v in checks.items()])
    Path(a.card).parent.mkdir(parents=True, exist_ok=True)
    Path(a.card).write_text(card)
    print(card)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": [r.__dict__ for r in rows], "checks": checks}, indent=2))
    print(f"[{time.time() - t0:.0f}s] done; card written to {a.card}")


if __name__ == "__main__":
    main()
