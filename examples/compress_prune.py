"""Prune a small causal LM fine-tuned here: 50% of MLP rows and of attention heads (gradual, l1), recovered by
fine-tuning, then cleaned into a genuinely smaller transformers model that save_pretrained's and reloads with
from_pretrained (config updated). Prints size / latency / perplexity and writes a model card.

    python examples/compress_prune.py --out /tmp/hf_zero_pruned              # a few CPU minutes
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import LlamaForCausalLM

from compress_common import base_model, token_blocks, train
from hf_zero.compression import CompressionCallback, init_compression
from hf_zero.compression.export import linear_weight_nbytes
from hf_zero.compression.measure import cpu_latency, perplexity, size_on_disk
from hf_zero.compression.model_card import Measurement, write_model_card


def prune_config(steps: int) -> dict:
    ramp = {"schedule_offset": 0, "schedule_offset_end": steps // 2, "schedule_offset_stride": max(1, steps // 10)}
    return {"compression_training": {
        "row_pruning": {"shared_parameters": {"enabled": True, "method": "l1", **ramp},
                        "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["mlp.up_proj"],
                                                     "related_modules": [["mlp.gate_proj", "mlp.down_proj"]]}}},
        "head_pruning": {"shared_parameters": {"enabled": True, "method": "l1", **ramp},
                         "different_groups": {"hp1": {"params": {"dense_ratio": 0.5}, "modules": ["o_proj"],
                                                      "related_modules": [["q_proj", "k_proj", "v_proj"]]}}},
    }}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="/tmp/hf_zero_pruned")
    p.add_argument("--base", default="/tmp/hf_zero_base_model", help="fine-tuned base (trained here if absent)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--base-steps", type=int, default=200)
    p.add_argument("--prune-steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base = base_model(a.base, hidden=a.hidden, steps=a.base_steps)
    cfg = prune_config(a.prune_steps)

    pruned = init_compression(LlamaForCausalLM.from_pretrained(a.base).train(), cfg)
    train(pruned, a.prune_steps, os.path.join(a.out, "_trainer"), lr=1e-3,
          callbacks=[CompressionCallback(cfg, clean_at_end=True)])
    pruned.save_pretrained(a.out)
    reloaded = LlamaForCausalLM.from_pretrained(a.out).eval()
    print(f"reloaded: intermediate_size {base.config.intermediate_size} -> {reloaded.config.intermediate_size}, "
          f"heads {base.config.num_attention_heads} -> {reloaded.config.num_attention_heads}")

    held = token_blocks("heldout")
    torch.set_num_threads(1)
    lat = cpu_latency([base, reloaded], held[:4])
    rows = [Measurement(n, size_on_disk(m), t, perplexity(m, held), linear_weight_nbytes(m))
            for (n, m), t in zip([("baseline", base), ("pruned 50% rows+heads, cleaned", reloaded)], lat)]
    for r in rows:
        print(f"{r.name:34s} {r.size_bytes / 2**20:6.2f} MiB  {r.latency_s * 1e3:7.1f} ms  ppl {r.perplexity:.3f}")
    card = write_model_card(a.out, title="Small byte-level Llama, 50% structured pruning", base_model=a.base,
                            steps=[f"row_pruning (MLP) and head_pruning to dense_ratio 0.5, cubic ramp over "
                                   f"{a.prune_steps // 2} steps, {a.prune_steps} fine-tuning steps in all",
                                   "redundancy_clean removed the pruned rows and heads and updated the config"],
                            results=rows, compression_config=cfg,
                            eval_data="examples/data/synthetic_heldout.txt", latency_setup="(4, 128), 1 thread")
    print(f"model card: {card}")


if __name__ == "__main__":
    main()
