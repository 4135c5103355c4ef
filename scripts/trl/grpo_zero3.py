"""TRL's GRPOTrainer with a DeepSpeed config (ZeRO stage from argv[1], default 3), answered by hf_zero: a tiny
Llama built from its config, a byte-level tokenizer (scripts/peer_suites/hub.py), 16 prompts, a length reward,
3 steps. Rank 0 prints the logged loss and reward of each step.

    pip install trl datasets            # not hf_zero dependencies
    python -m torch.distributed.run --nproc_per_node 2 scripts/trl/grpo_zero3.py 3

Recorded in docs/deepspeed_scripts.md ("TRL's generation under ZeRO-3"). The prompts are a Dataset built from an
Arrow table with a fixed fingerprint: datasets' own fingerprinting (dill) failed on pyarrow's MonthDayNano type in
the environment this was written in, which has nothing to do with the engine.
"""

import json
import os
import sys

import pyarrow as pa
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peer_suites"))
from hub import _write_tokenizer  # noqa: E402

BASE = os.environ.get("GRPO_BASE", "/tmp/hf_zero_grpo_base")


def reward_len(completions, **_):
    return [-abs(8 - len(c)) / 8.0 for c in completions]


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and not os.path.isdir(BASE):
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=257, max_position_embeddings=256, bos_token_id=256,
                          eos_token_id=256, pad_token_id=256)
        LlamaForCausalLM(cfg).save_pretrained(BASE)
        _write_tokenizer("bytes", BASE)
    torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()  # the model directory exists
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    prompts = Dataset(pa.table({"prompt": [f"count {i}:" for i in range(16)]}), fingerprint="grpo-prompts")
    args = GRPOConfig(output_dir=os.path.join(os.path.dirname(BASE), f"hf_zero_grpo_out{stage}"),
                      per_device_train_batch_size=2, num_generations=2, max_completion_length=8, max_steps=3,
                      logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-3, deepspeed=ds,
                      use_cpu=True, seed=0, bf16=False)
    trainer = GRPOTrainer(model=BASE, reward_funcs=reward_len, args=args, train_dataset=prompts)
    trainer.train()
    if rank == 0:
        print("LOGS", json.dumps([{k: v for k, v in h.items() if k in ("loss", "reward", "step")}
                                  for h in trainer.state.log_history if "loss" in h]))


if __name__ == "__main__":
    main()
