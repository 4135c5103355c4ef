"""Tensor parallelism vs ZeRO-3 and plain data parallelism on 2 CPU processes, in one run.

    python benchmarks/bench_tp.py                  # every runner, a table
    python benchmarks/bench_tp.py --steps 10 --runners tp2,ddp

Runners (all hf_zero.initialize, fp32, AdamW, the same Llama built from config, the same global batch):
    ddp    ZeRO stage 0 over 2 data-parallel ranks (every rank holds everything)
    zero3  ZeRO stage 3 over 2 data-parallel ranks
    tp2    tensor_parallel.autotp_size 2 (one replica, the model split over the 2 ranks), ZeRO stage 0
    ds_tp2 DeepSpeed's AutoTP (autotp_size 2), only when a real DeepSpeed is importable (--ds-python)

Reported per runner: median step time, peak RSS growth per rank over the process's baseline, and parameter bytes
per rank. For tp2 the parameter bytes are compared with the expectation: 1/TP of the sharded matrices plus the
replicated tensors (norms), which must agree within 5%. The machine is shared: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNNERS = ["ddp", "zero3", "tp2", "ds_tp2"]
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=128)
MICRO, SEQ = 4, 128


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(runner: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    base_rss = _rss_bytes()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    import deepspeed  # hf_zero's shim, or a real DeepSpeed (ds_tp2)

    stage = 3 if runner == "zero3" else 0
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage},
           "steps_per_print": 10 ** 9}
    tp = runner in ("tp2", "ds_tp2")
    if tp:
        cfg["tensor_parallel"] = {"autotp_size": 2}
        model = deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float32, config=cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = dist.get_rank()
    dp = 1 if tp else 2
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, MODEL["vocab_size"], (steps + 2, dp, MICRO, SEQ), generator=g)
    times = []
    for s in range(steps + 2):  # two warm-up steps
        ids = data[s, 0 if tp else rank]
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if s >= 2:
            times.append(time.perf_counter() - t0)
    param_bytes = expected = None
    if runner == "tp2":
        from hf_zero.tensor_parallel.apply import is_tp_sharded
        from hf_zero.zero.local import local_tensor

        params = list(engine.module.parameters())
        param_bytes = sum(local_tensor(p).numel() * p.element_size() for p in params)
        expected = sum((p.numel() / 2 if is_tp_sharded(p) else p.numel()) * p.element_size() for p in params)
    elif runner == "ddp":
        param_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    elif runner == "zero3":
        param_bytes = sum(p.ds_tensor.numel() * p.element_size() for p in engine.module.parameters()
                          if hasattr(p, "ds_tensor"))
    result = {"step_s": statistics.median(times), "rss_growth": _rss_bytes() - base_rss,
              "param_bytes": param_bytes, "expected_param_bytes": expected}
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))


def _launch(python: str, runner: str, steps: int, tmp: str, env: dict) -> list[dict] | None:
    out = os.path.join(tmp, runner)
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, "--worker", runner,
           "--steps", str(steps), "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(f"{runner}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runners", default=",".join(RUNNERS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ds-python", default=None, help="python of a virtual environment with a real DeepSpeed")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.out)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for runner in args.runners.split(","):
            python = sys.executable
            if runner == "ds_tp2":
                if args.ds_python is None:
                    print("ds_tp2: skipped (no --ds-python with a real DeepSpeed)")
                    continue
                python = args.ds_python
            res = _launch(python, runner, args.steps, tmp, env)
            if res is not None:
                rows.append((runner, res))
    print(f"{'runner':8} {'step s':>8} {'RSS growth MiB/rank':>20} {'param MiB/rank':>15} {'expected':>9}")
    for runner, res in rows:
        step = statistics.median(r["step_s"] for r in res)
        rss = max(r["rss_growth"] for r in res) / 2 ** 20
        pb = res[0]["param_bytes"]
        exp = res[0]["expected_param_bytes"]
        print(f"{runner:8} {step:8.3f} {rss:20.1f} {pb / 2 ** 20 if pb else float('nan'):15.2f} "
              f"{exp / 2 ** 20 if exp else float('nan'):9.2f}")
        if exp:
            ratio = pb / exp
            print(f"         tp2 parameter bytes / (sharded / TP + replicated) = {ratio:.4f} "
                  f"({'within' if abs(ratio - 1) <= 0.05 else 'OUTSIDE'} 5%)")


if __name__ == "__main__":
    main()
