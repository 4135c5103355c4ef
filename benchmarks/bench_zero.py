"""hf_zero ZeRO stages vs DDP, FSDP2 and DeepSpeed, side by side in one run, on 2 CPU processes.

    python benchmarks/bench_zero.py                 # every runner, prints a table of ratios
    python benchmarks/bench_zero.py --steps 20 --runners hf_zero_z2,ddp

Every runner trains the same Llama (built from config) on the same token batches, bf16 compute with fp32 master
weights, AdamW, one optimizer step per micro-batch, launched with torchrun (DeepSpeed from its own virtual
environment, ``--ds-python``, since hf_zero answers ``import deepspeed`` where DeepSpeed is absent). Reported per
runner: median step time, peak RSS growth per rank over the process's baseline, and -- for hf_zero, which can
count them exactly -- model-state bytes per parameter against the ZeRO paper's formulas (Z1: 4+12/N, Z2: 2+14/N,
Z3: 16/N bytes per parameter for mixed-precision Adam). Absolute times drift on shared machines; the ratios
within one run are the result.
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

RUNNERS = ["ddp", "fsdp2", "deepspeed_z1", "deepspeed_z2", "deepspeed_z3", "hf_zero_z1", "hf_zero_z2",
           "hf_zero_z3"]
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256)
MICRO, SEQ, LR = 4, 128, 1e-4


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 5e7,
                                  "allgather_bucket_size": 5e7, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 10 ** 9}


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL))


def worker(runner: str, steps: int, out_dir: str) -> None:
    """One rank of one runner (under torchrun). Writes its measurements as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    baseline = _rss_bytes()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=g) for _ in range(steps)]
    model = _model()
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = None

    if runner.startswith("hf_zero"):
        import hf_zero

        engine, *_ = hf_zero.initialize(model=model, config=_ds_config(int(runner[-1])))

        def step(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss

        def measure_state():
            params = sum(t.numel() * t.element_size() for t in engine.module.parameters())
            if engine.stage3 is not None:
                params = sum(sp.local_shard.numel() * sp.local_shard.element_size()
                             for sp in engine.stage3.sharded_params())
            grads = sum(g.grad.numel() * g.grad.element_size() for g in engine.groups)
            full_grads = 2 * n_params if engine.stage in (0, 1) else 0  # held between micro-steps (bf16)
            opt = sum(t.numel() * t.element_size() for g in engine.groups
                      for t in [g.master, *engine.optimizer.state[g.master].values()] if t.numel() > 1)
            return params + grads + full_grads + opt
    elif runner.startswith("deepspeed"):
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=_ds_config(int(runner[-1])))

        def step(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss
        measure_state = None
    else:
        dist.init_process_group("gloo")
        if runner == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model)
            params = wrapped.parameters()
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp)
            wrapped = fully_shard(model, mp_policy=mp)
            params = wrapped.parameters()
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)

        def step(ids):
            if runner == "ddp":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = wrapped(input_ids=ids, labels=ids).loss
            else:
                loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        measure_state = None

    times, losses = [], []
    for i, ids in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        loss = step(ids)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach().float()))
        if measure_state is not None and i == 1:
            state_bytes = measure_state()
    warm = times[2:] if len(times) > 4 else times
    result = {"runner": runner, "rank": rank, "world": world, "n_params": n_params,
              "step_s": statistics.median(warm), "peak_rss_growth": _rss_bytes() - baseline,
              "state_bytes": state_bytes, "first_loss": losses[0], "last_loss": losses[-1]}
    Path(out_dir, f"{runner}.{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def _launch(runner: str, steps: int, out_dir: str, ds_python: str | None) -> str | None:
    python = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if runner.startswith("deepspeed"):
        if not ds_python or not Path(ds_python).exists():
            return f"skipped: no DeepSpeed python ({ds_python})"
        python = ds_python
        env["DS_ACCELERATOR"] = "cpu"
        env["HF_ZERO_DISABLE_DEEPSPEED_SHIM"] = "1"
    from hf_zero.comm.process_group import free_port

    port = free_port()
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           __file__, "--worker", runner, "--steps", str(steps), "--out", out_dir]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        return f"failed (exit {proc.returncode}):\n{tail}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--ds-python", default="/opt/dsvenv/bin/python",
                        help="python of a virtual environment with the real DeepSpeed installed")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return

    out_dir = tempfile.mkdtemp(prefix="bench_zero_")
    notes = {}
    for runner in args.runners.split(","):
        print(f"running {runner} ...", flush=True)
        note = _launch(runner, args.steps, out_dir, args.ds_python)
        if note:
            notes[runner] = note
    rows = {}
    for f in sorted(Path(out_dir).glob("*.json")):
        r = json.loads(f.read_text())
        rows.setdefault(r["runner"], []).append(r)
    world = 2
    formulas = {"hf_zero_z1": 4 + 12 / world, "hf_zero_z2": 2 + 14 / world, "hf_zero_z3": 16 / world}
    ref = {"hf_zero_z1": "deepspeed_z1", "hf_zero_z2": "deepspeed_z2", "hf_zero_z3": "deepspeed_z3"}

    def agg(runner, key):
        return max(r[key] for r in rows[runner]) if runner in rows else None

    print(f"\nLlama {MODEL['hidden_size']}h x {MODEL['num_hidden_layers']}L, "
          f"{rows[next(iter(rows))][0]['n_params'] / 1e6:.2f}M params, micro-batch {MICRO}x{SEQ}, "
          f"2 ranks, bf16, AdamW\n")
    header = f"{'runner':14s} {'step ms':>8s} {'peak RSS MB':>11s} {'vs DS time':>10s} {'vs DS mem':>9s} " \
             f"{'vs DDP time':>11s} {'vs FSDP2 time':>13s} {'state B/param':>13s} {'formula':>7s} {'loss':>13s}"
    print(header)
    print("-" * len(header))
    for runner in RUNNERS:
        if runner not in rows:
            if runner in notes:
                print(f"{runner:14s} {notes[runner].splitlines()[0]}")
            continue
        t, m = agg(runner, "step_s"), agg(runner, "peak_rss_growth")
        ds = ref.get(runner, runner if runner.startswith("deepspeed") else None)

        def ratio(a, other, key):
            b = agg(other, key) if other else None
            return f"{a / b:.2f}x" if b else "-"
        sb = rows[runner][0]["state_bytes"]
        per_param = f"{sb / rows[runner][0]['n_params']:.2f}" if sb else "-"
        formula = f"{formulas[runner]:.2f}" if runner in formulas else "-"
        loss = f"{rows[runner][0]['first_loss']:.3f}->{rows[runner][0]['last_loss']:.3f}"
        print(f"{runner:14s} {1000 * t:8.1f} {m / 2**20:11.1f} {ratio(t, ds, 'step_s'):>10s} "
              f"{ratio(m, ds, 'peak_rss_growth'):>9s} {ratio(t, 'ddp', 'step_s'):>11s} "
              f"{ratio(t, 'fsdp2', 'step_s'):>13s} {per_param:>13s} {formula:>7s} {loss:>13s}")
    for runner, note in notes.items():
        if runner in rows or not note.startswith("failed"):
            continue
        print(f"\n{runner} {note}")


if __name__ == "__main__":
    main()
