"""Quantize a small causal LM fine-tuned here: 8-bit quantization-aware fine-tuning (weights per channel,
activations dynamic), folded by redundancy_clean, exported to real int8 modules for CPU -- and, when
bitsandbytes is installed, to 4-bit NF4 layers. Prints size / latency / perplexity and writes a model card.

    python examples/compress_quantize.py --out /tmp/hf_zero_quantized        # a few CPU minutes
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from safetensors.torch import save_model

from compress_common import base_model, token_blocks, train
from hf_zero.compression import CompressionCallback, export_bnb, export_int8, init_compression
from hf_zero.compression.export import linear_weight_nbytes
from hf_zero.compression.measure import cpu_latency, perplexity, size_on_disk
from hf_zero.compression.model_card import Measurement, write_model_card

QAT = {"compression_training": {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantization_type": "symmetric",
                              "per_channel": True},
        "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["self_attn", "mlp"]}},
    },
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantization_type": "asymmetric",
                              "range_calibration": "dynamic"},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["self_attn", "mlp"]}},
    },
}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="/tmp/hf_zero_quantized")
    p.add_argument("--base", default="/tmp/hf_zero_base_model", help="fine-tuned base (trained here if absent)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--base-steps", type=int, default=200)
    p.add_argument("--qat-steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base = base_model(a.base, hidden=a.hidden, steps=a.base_steps)

    qat = init_compression(copy.deepcopy(base).train(), QAT)
    train(qat, a.qat_steps, os.path.join(a.out, "_trainer"), lr=2e-4,
          callbacks=[CompressionCallback(QAT, clean_at_end=True)])  # weights folded onto the 8-bit grid
    int8 = export_int8(qat.eval(), skip=["lm_head"])
    os.makedirs(a.out, exist_ok=True)
    save_model(int8, os.path.join(a.out, "model_int8.safetensors"))  # load: export_int8(model) then load_state_dict

    variants = [("baseline fp32", base), ("8-bit QAT -> int8", int8)]
    try:
        variants.append(("bitsandbytes NF4 (post-training)", export_bnb(copy.deepcopy(base), bits=4,
                                                                        skip=["lm_head"])))
    except RuntimeError as err:
        print(f"skipping bitsandbytes 4-bit: {err}")
    held = token_blocks("heldout")
    torch.set_num_threads(1)
    lat = cpu_latency([m for _, m in variants], held[:4])
    rows = [Measurement(n, size_on_disk(m), t, perplexity(m, held), linear_weight_nbytes(m))
            for (n, m), t in zip(variants, lat)]
    for r in rows:
        print(f"{r.name:34s} {r.size_bytes / 2**20:6.2f} MiB  {r.latency_s * 1e3:7.1f} ms  ppl {r.perplexity:.3f}")
    card = write_model_card(a.out, title="Small byte-level Llama, int8", base_model=a.base,
                            steps=[f"{a.qat_steps} steps of 8-bit quantization-aware fine-tuning (weights per "
                                   f"channel, symmetric; activations 8-bit dynamic)",
                                   "redundancy_clean folded the quantized weights",
                                   "export_int8: int8 weights + dynamic 8-bit activations (PyTorch x86 kernels); "
                                   "lm_head kept in fp32"],
                            results=rows, compression_config=QAT,
                            eval_data="examples/data/synthetic_heldout.txt", latency_setup="(4, 128), 1 thread")
    print(f"model card: {card}")


if __name__ == "__main__":
    main()
