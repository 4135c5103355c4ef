"""TRL's DPOTrainer with a DeepSpeed config (ZeRO stage from argv[1]), answered by hf_zero: policy and reference
model loaded after the config is registered (so under zero.Init at stage 3; TRL prepares the reference model as a
second, optimizer-less engine), 16 preference pairs, 3 steps. Rank 0 prints the logged loss and chosen reward.
Needs the tiny model scripts/trl/grpo_zero3.py writes (run it first) and ``pip install trl datasets``:

    python -m torch.distributed.run --nproc_per_node 2 scripts/trl/dpo_zero3.py 3
"""

import json
import os
import sys

import pyarrow as pa
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

BASE = os.environ.get("GRPO_BASE", "/tmp/hf_zero_grpo_base")


def main() -> None:
    torch.distributed.init_process_group("gloo")
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    n = 16
    pairs = Dataset(pa.table({"prompt": [f"q{i}:" for i in range(n)],
                              "chosen": [" yes" * (1 + i % 3) for i in range(n)],
                              "rejected": [" no"] * n}), fingerprint="dpo-pairs")
    args = DPOConfig(output_dir=os.path.join(os.path.dirname(BASE), f"hf_zero_dpo_out{stage}"),
                     per_device_train_batch_size=2, max_steps=3, logging_steps=1, report_to=[], save_strategy="no",
                     learning_rate=1e-3, deepspeed=ds, use_cpu=True, seed=0, bf16=False, max_length=32)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(BASE),
                         ref_model=AutoModelForCausalLM.from_pretrained(BASE), args=args, train_dataset=pairs,
                         processing_class=AutoTokenizer.from_pretrained(BASE))
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        print("LOGS", json.dumps([{k: round(v, 6) for k, v in h.items() if k in ("loss", "rewards/chosen", "step")}
                                  for h in trainer.state.log_history if "loss" in h]))


if __name__ == "__main__":
    main()
