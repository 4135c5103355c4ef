"""Writes the DeepSpeed checkpoints tests/test_deepspeed_checkpoints.py resumes from -- run with real DeepSpeed.

    # in a virtual environment with deepspeed (0.19.8 wrote the files here) and without hf_zero's shim:
    HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 make_fixtures.py OUT STAGE PREC GROUPS

Trains ``Tiny`` (below; the test builds the same model) three steps on 2 ranks, saves a checkpoint under
``OUT/ckpt`` (DeepSpeed's recovery scripts are deleted: they are DeepSpeed's code), then trains two more steps in the
same process -- what a resume on DeepSpeed continues with -- and writes ``OUT/continued.pt``: the values at the save (``saved:<name>``), the two steps'
losses (mean over ranks) and every trainable parameter's fp32 weight (and, with one group, its Adam moments) after them.
"""

import os
import sys

import torch

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.a = torch.nn.Linear(6, 7)
        self.b = torch.nn.Linear(7, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.arange(1.0, 4.0))

    def forward(self, x):
        return self.frozen(self.b(torch.relu(self.a(self.emb(x))))) * self.scale


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s micro-batch (2 rows of 4 tokens) at ``step``: the test concatenates the ranks' rows."""
    return torch.randint(0, 10, (2, 4), generator=torch.Generator().manual_seed(1000 * step + rank))


def config(stage: int, prec: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if prec == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def param_groups(model: torch.nn.Module, groups: int):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if groups == 1:
        return [p for _, p in trainable]
    return [{"params": [p for n, p in trainable if n.endswith("weight")]},
            {"params": [p for n, p in trainable if not n.endswith("weight")], "weight_decay": 0.0}]


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def main(out: str, stage: int, prec: str, groups: int) -> None:
    torch.manual_seed(0)
    model = Tiny()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, groups),
                                      config=config(stage, prec))
    rank, world = engine.global_rank, engine.world_size

    def train(step):
        loss = loss_of(engine(batch(step, rank)))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        return float(mean) / world

    def values(prefix: str) -> dict:
        out = {}
        for n, p in engine.module.named_parameters():
            if p.requires_grad:
                out[prefix + n] = safe_get_full_fp32_param(p)
                # (with two groups DeepSpeed 0.19.8's safe_get_full_optimizer_state raises "exp_avg not found" at
                # stages 1/2 for a parameter whose fragment is on another rank)
                for key in (("exp_avg", "exp_avg_sq") if groups == 1 else ()):
                    out[f"{prefix}{n}:{key}"] = safe_get_full_optimizer_state(p, key)
        return out

    for step in range(3):
        train(step)
    at_save = values("saved:")
    engine.save_checkpoint(os.path.join(out, "ckpt"), client_state={"epoch": 7})
    losses = [train(step) for step in (3, 4)]
    ref = {"losses": losses, "lr": engine.lr_scheduler.get_last_lr()[0], **at_save, **values("")}
    torch.distributed.barrier()
    if rank == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            path = os.path.join(out, "ckpt", script)
            if os.path.exists(path):
                os.remove(path)
        torch.save(ref, os.path.join(out, "continued.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
