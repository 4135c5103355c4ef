"""The DeepSpeed side of tests/test_zenflow.py's recorded numbers: its model, data and config, on a real DeepSpeed.

    HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu /path/to/deepspeed/python -m deepspeed.launcher.runner \\
        --num_gpus 1 scripts/zenflow/ds_reference_run.py '{"dtype": "fp32", "zenflow": {...}, "steps": 8}'

Optional keys: "clip" (gradient_clipping), "scheduler" (a DeepSpeed scheduler section), "stage" (1, 2 or 3; 2 by
default), "zero" (more zero_optimization keys). Prints, on rank 0, one line
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


def _stage3_on_cpu() -> None:
    """DeepSpeed 0.19.8's stage-3 ZenFlow (runtime/zenflow/engine_stage3.py) allocates its column-sum buffer and
    selected indices with ``device='cuda'`` written out; nothing else in it names a device. On a CPU build those two
    go to the CPU, so the recorded stage-3 numbers are DeepSpeed's own code."""
    import types

    try:
        import deepspeed.runtime.zenflow.engine_stage3 as stage3
    except ImportError:  # hf_zero answering `import deepspeed`: nothing to patch
        return
    if torch.cuda.is_available():
        return

    def on_cpu(kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return kwargs

    proxy = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.zeros = lambda *a, **kw: torch.zeros(*a, **on_cpu(kw))
    proxy.tensor = lambda *a, **kw: torch.tensor(*a, **on_cpu(kw))
    stage3.torch = proxy


def main() -> None:
    spec = json.loads(sys.argv[-1])
    stage = int(spec.get("stage", 2))
    if stage == 3:
        _stage3_on_cpu()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8))
    cfg = {"train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}, "zenflow": spec["zenflow"],
                                 **spec.get("zero", {})},
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
    # stage 3: the parameters are partitioned between forwards; gathered (on every rank) to be read whole
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        sums = [p.detach().float().sum().item() for p in engine.module.parameters()]
    if rank == 0:
        print("ZFREF " + json.dumps({"losses": losses, "param_sums": sums}))


if __name__ == "__main__":
    main()
