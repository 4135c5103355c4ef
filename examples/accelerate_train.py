"""A custom training loop with 🤗 accelerate, run by hf_zero through ``accelerate launch`` and a DeepSpeed config.

An ordinary accelerate script (``Accelerator`` + ``prepare`` + ``backward`` + ``step``); the DeepSpeed settings
come from the launch config, and with hf_zero installed they run on hf_zero's engine:

    accelerate launch --config_file integrations/accelerate_zero2_cpu.yaml examples/accelerate_train.py
    accelerate launch --config_file integrations/accelerate_zero3.yaml examples/accelerate_train.py   # GPUs

On a CPU-only machine write ``Accelerator()`` as here: ``Accelerator(cpu=True)`` makes accelerate drop DeepSpeed
(its rule, in ``AcceleratorState``), and hf_zero makes the plain ``Accelerator()`` see every process.

The model is a 2-layer Llama built from its config and the data is generated (``hf_tiny.py``). ``--record`` writes,
per rank, what it saw (process count, the sample indices of each batch, the losses) so a test can check the data
sharding and replay the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_tiny import synthetic_lm_dataset, tiny_llama_config  # noqa: E402


class IndexedDataset(torch.utils.data.Dataset):
    """The examples' dataset, with each sample's index added (to show which rank trained on what)."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return {**self.base[i], "index": torch.tensor(i)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default=None, help="a local model directory; default: a tiny Llama "
                                                             "built from its config")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=2, help="per process")
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--output_dir", default="out/accelerate")
    p.add_argument("--record", default=None, help="write <record>.rank<N>.json per rank")
    args = p.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator()
    set_seed(0)
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    data = torch.utils.data.DataLoader(IndexedDataset(synthetic_lm_dataset(256, seed=0)),
                                       batch_size=args.batch_size, shuffle=True)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)

    model.train()
    losses, indices = [], []
    batches = iter(data)
    for step in range(args.steps):
        batch = next(batches)
        indices.append(batch.pop("index").tolist())
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        # the loss of the global batch: every rank's batch has the same number of tokens
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        accelerator.print(f"step {step + 1}: loss {losses[-1]:.4f}")

    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)
    if args.record:
        with open(f"{args.record}.rank{accelerator.process_index}.json", "w") as f:
            json.dump({"num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
                       "distributed_type": str(accelerator.distributed_type), "indices": indices,
                       "losses": losses, "engine": type(model).__name__,
                       "zero_stage": accelerator.state.deepspeed_plugin.zero_stage
                       if accelerator.state.deepspeed_plugin else None}, f)


if __name__ == "__main__":
    main()
