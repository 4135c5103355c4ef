"""The DeepSpeed side of tests/test_zenflow.py's recorded numbers: its model, data and config, on a real DeepSpeed.

    HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu /path/to/deepspeed/python -m deepspeed.launcher.runner \\
        --num_gpus 1 scripts/zenflow/ds_reference_run.py '{"dtype": "fp32", "zenflow": {...}, "steps": 8}'

Optional keys: "clip" (gradient_clipping), "scheduler" (a DeepSpeed scheduler section). Prints, on rank 0, one line
``ZFREF {"losses": [...], "param_sums": [...]}`` (losses averaged over the ranks). Without the environment variable
the same script runs on hf_zero through its ``deepspeed`` shim. The ``__main__`` guard matters: overlap_step spawns
a process that imports this file.
"""

import json
import sys

import torch

import deepspeed
import deepspeed.comm as dist

MICRO = 4


def main() -> None:
    spec = json.loads(sys.argv[-1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8))
    cfg = {"train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": spec["zenflow"]},
           "gradient_clipping": spec.get("clip", 0.0),
           "zero_allow_untested_optimizer": True}
    if "scheduler" in spec:
        cfg["scheduler"] = spec["scheduler"]
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    g = torch.Generator().manual_seed(100)
    losses = []
    for _ in range(spec.get("steps", 8)):
        xs, ys = torch.randn(world * MICRO, 16, generator=g), torch.randn(world * MICRO, 8, generator=g)
        x, y = xs[rank * MICRO:(rank + 1) * MICRO].to(dtype), ys[rank * MICRO:(rank + 1) * MICRO].to(dtype)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if rank == 0:
        sums = [p.detach().float().sum().item() for p in engine.module.parameters()]
        print("ZFREF " + json.dumps({"losses": losses, "param_sums": sums}))


if __name__ == "__main__":
    main()
