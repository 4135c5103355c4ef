"""Distil a small causal LM fine-tuned here into a student with half its layers: layer_reduction (through
init_compression, the DeepSpeed way) copies chosen teacher layers into the student, DistillationTrainer trains it
on teacher logits (temperature) and hidden states; the same student trained without a teacher is the control.

    python examples/compress_distill.py --out /tmp/hf_zero_distilled         # a few CPU minutes
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from transformers import LlamaForCausalLM

from compress_common import base_model, token_blocks, train
from hf_zero.compression import DistillationTrainer, init_compression
from hf_zero.compression.distillation import default_layer_map
from hf_zero.compression.export import linear_weight_nbytes
from hf_zero.compression.measure import cpu_latency, perplexity, size_on_disk
from hf_zero.compression.model_card import Measurement, write_model_card


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="/tmp/hf_zero_distilled")
    p.add_argument("--base", default="/tmp/hf_zero_base_model", help="fine-tuned base (trained here if absent)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--base-steps", type=int, default=200)
    p.add_argument("--distill-steps", type=int, default=80)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    teacher = base_model(a.base, hidden=a.hidden, steps=a.base_steps)
    n = teacher.config.num_hidden_layers
    keep = n // 2
    teacher_layer = list(range(1, n, 2))[:keep]
    cfg = {"compression_training": {"layer_reduction": {
        "enabled": True, "keep_number_layer": keep, "module_name_prefix": "model.layers",
        "teacher_layer": teacher_layer, "other_module_name": ["model.embed_tokens", "model.norm", "lm_head"]}}}

    def student() -> LlamaForCausalLM:
        config = copy.deepcopy(teacher.config)
        config.num_hidden_layers = keep
        return init_compression(LlamaForCausalLM(config), cfg, teacher_model=teacher).train()

    distilled = student()
    train(distilled, a.distill_steps, os.path.join(a.out, "_kd"), lr=1e-3, trainer_cls=DistillationTrainer,
          teacher_model=teacher, temperature=1.0, alpha=0.5, hidden_weight=0.1,
          layer_map=default_layer_map(keep, n, teacher_layer))
    control = student()
    train(control, a.distill_steps, os.path.join(a.out, "_ce"), lr=1e-3)
    distilled.save_pretrained(a.out)

    held = token_blocks("heldout")
    torch.set_num_threads(1)
    variants = [("teacher", teacher.eval()), (f"distilled student ({keep}/{n})", distilled.eval()),
                (f"same student, no teacher ({keep}/{n})", control.eval())]
    lat = cpu_latency([m for _, m in variants], held[:4])
    rows = [Measurement(name, size_on_disk(m), t, perplexity(m, held), linear_weight_nbytes(m))
            for (name, m), t in zip(variants, lat)]
    for r in rows:
        print(f"{r.name:34s} {r.size_bytes / 2**20:6.2f} MiB  {r.latency_s * 1e3:7.1f} ms  ppl {r.perplexity:.3f}")
    card = write_model_card(a.out, title=f"Small byte-level Llama, distilled to {keep} layers", base_model=a.base,
                            steps=[f"layer_reduction: student layers initialized from teacher layers {teacher_layer}",
                                   f"{a.distill_steps} steps of DistillationTrainer (T=1, alpha=0.5, hidden-state "
                                   f"loss 0.1)"],
                            results=rows, compression_config=cfg,
                            eval_data="examples/data/synthetic_heldout.txt", latency_setup="(4, 128), 1 thread")
    print(f"model card: {card}")


if __name__ == "__main__":
    main()
