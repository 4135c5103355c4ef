"""Tensor parallelism vs ZeRO-3, plain data parallelism and DeepSpeed AutoTP on 2 CPU processes, in one run.

    python benchmarks/bench_tp.py --ds-python /work/dsvenv/bin/python     # every runner, interleaved rounds
    python benchmarks/bench_tp.py --ds-python /work/dsvenv/bin/python --runners tp2,ds_tp2 --size 5m,32m
    python benchmarks/bench_tp.py --steps 10 --rounds 5 --runners tp2,ddp

Runners (all hf_zero.initialize, fp32, AdamW, the same Llama built from config, the same global batch):
    ddp    ZeRO stage 0 over 2 data-parallel ranks (every rank holds everything)
    zero3  ZeRO stage 3 over 2 data-parallel ranks
    tp2    tensor_parallel.autotp_size 2 (one replica, the model split over the 2 ranks), ZeRO stage 0
    tp2_sp tp2 with tensor_parallel.sequence_parallel (norms and residual stream split along the sequence)
    tp2_base  tp2 with hf_zero imported from --base-src (a copy of hf_zero/ at another commit: before / after)
    ds_tp2 DeepSpeed's AutoTP (deepspeed.tp_model_init + initialize with tensor_parallel.autotp_size 2, ZeRO 0, its
           CPU FusedAdam), run by a python with a real DeepSpeed (--ds-python; DS_ACCELERATOR=cpu is set)

Each round launches every runner once (torchrun, 2 ranks), the order rotated from round to round so that load
drifts on the shared machine fall on all runners alike; each launch times ``--steps`` steps after 2 warm-up steps.
Reported per runner and rank: step time (median over rounds of each launch's median; for the TP ratios also the
process CPU time per step, which a loaded machine inflates less than wall time: a rank that waits for a
descheduled peer spends wall time, not CPU time), peak RSS (the process's
high-water mark) and its growth over the RSS after the imports, and parameter bytes. For the TP runners the
parameter bytes are compared with 1/TP of the parameters their tensor-parallel layers split (hf_zero: the DTensor
shards of its plan; DeepSpeed: the parameters of the modules AutoTP replaced) plus the whole of the others, which
must agree within 5%. Ratios are of medians within the run; the machine is shared, so quote its load.
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

RUNNERS = ["ddp", "zero3", "tp2", "tp2_sp", "ds_tp2"]
SIZES = {  # "32m" is benchmarks/bench_zero.py's 32M Llama
    "5m": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=128),
    "32m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=128),
}
MICRO, SEQ = 4, 128


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(runner: str, size: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    import deepspeed  # hf_zero's shim, or a real DeepSpeed (ds_tp2)

    base_rss = _rss_now()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES[size]))
    full = {n: p.numel() for n, p in model.named_parameters()}  # unsplit sizes, by name

    stage = 3 if runner == "zero3" else 0
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage},
           "steps_per_print": 10 ** 9}
    tp = runner in ("tp2", "tp2_base", "tp2_sp", "ds_tp2")
    if tp:
        cfg["tensor_parallel"] = {"autotp_size": 2, **({"sequence_parallel": True} if runner == "tp2_sp" else {})}
        model = deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float32, config=cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = dist.get_rank()
    dp = 1 if tp else 2
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, SIZES[size]["vocab_size"], (steps + 2, dp, MICRO, SEQ), generator=g)
    times, cpu, losses = [], [], []
    for s in range(steps + 2):  # two warm-up steps
        ids = data[s, 0 if tp else rank]
        t0, c0 = time.perf_counter(), time.process_time()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if s >= 2:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        losses.append(float(loss))
    param_bytes, expected, split = _param_bytes(runner, engine.module, full)
    result = {"step_s": statistics.median(times), "cpu_s": statistics.median(cpu), "hf_zero": sys.modules["hf_zero"].__file__ if "hf_zero" in
              sys.modules else None, "peak_rss": _rss_bytes(), "rss_growth": _rss_bytes() - base_rss,
              "param_bytes": param_bytes, "expected_param_bytes": expected, "split_params": split,
              "first_loss": losses[0]}
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _param_bytes(runner: str, module, full: dict[str, int]) -> tuple[int, int | None, int | None]:
    """(bytes this rank holds, expected bytes for a TP runner, how many parameters its TP layers split)."""
    if runner == "zero3":
        return sum(p.ds_tensor.numel() * p.element_size() for p in module.parameters() if hasattr(p, "ds_tensor")), \
            None, None
    if runner == "ddp":
        return sum(p.numel() * p.element_size() for p in module.parameters()), None, None
    if runner in ("tp2", "tp2_base", "tp2_sp"):
        from hf_zero.tensor_parallel.apply import is_tp_sharded
        from hf_zero.zero.local import local_tensor

        split = {n for n, p in module.named_parameters() if is_tp_sharded(p)}
        local = {n: local_tensor(p).numel() * p.element_size() for n, p in module.named_parameters()}
    else:  # DeepSpeed AutoTP: the parameters of the modules it replaced with its tensor-parallel layers
        from deepspeed.module_inject.layers import TensorParallel_Layer

        split = {f"{m}.{n}" if m else n for m, mod in module.named_modules() if isinstance(mod, TensorParallel_Layer)
                 for n, _ in mod.named_parameters(recurse=False)}
        local = {n: p.numel() * p.element_size() for n, p in module.named_parameters()}
    size = next(iter(module.parameters())).element_size()
    expected = sum((full[n] / 2 if n in split else full[n]) * size for n in local)
    return sum(local.values()), int(expected), len(split)


def _launch(python: str, runner: str, size: str, steps: int, tmp: str, env: dict) -> list[dict] | None:
    out = os.path.join(tmp, f"{runner}.{size}")
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, "--worker", runner,
           "--size", size, "--steps", str(steps), "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(f"{runner}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]


def _env(env: dict, runner: str, base_src: str | None) -> dict:
    if runner == "ds_tp2":  # the real DeepSpeed, not hf_zero's shim of it
        return dict(env, HF_ZERO_DISABLE_DEEPSPEED_SHIM="1")
    if runner == "tp2_base":
        return dict(env, PYTHONPATH=os.pathsep.join(p for p in (base_src, env.get("PYTHONPATH")) if p))
    return env


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runners", default=",".join(RUNNERS))
    ap.add_argument("--size", default="5m", help="comma-separated model sizes, each launched in every round: "
                    + ", ".join(SIZES))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ds-python", default=None, help="python of a virtual environment with a real DeepSpeed")
    ap.add_argument("--base-src", default=None, help="directory holding another hf_zero/ package: adds the runner "
                    "tp2_base, tp2 run with it first on PYTHONPATH")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.size, args.steps, args.out)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    runners = args.runners.split(",")
    if args.base_src and "tp2_base" not in runners:
        runners.append("tp2_base")
    if "ds_tp2" in runners and args.ds_python is None:
        print("ds_tp2: skipped (no --ds-python with a real DeepSpeed)")
        runners.remove("ds_tp2")
    sizes = args.size.split(",")
    runs: dict[str, dict[str, list[list[dict]]]] = {z: {r: [] for r in runners} for z in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = runners[rnd % len(runners):] + runners[:rnd % len(runners)]
            for size in sizes:
                for runner in order:
                    python = args.ds_python if runner == "ds_tp2" else sys.executable
                    t0 = time.time()
                    res = _launch(python, runner, size, args.steps, tmp, _env(env, runner, args.base_src))
                    print(f"round {rnd} {size:4} {runner:7} {'failed' if res is None else 'ok'} in "
                          f"{time.time() - t0:.0f} s, load {_loadavg()}", flush=True)
                    if res is not None:
                        runs[size][runner].append(res)
    for size in sizes:
        print(f"\n== {size} Llama ({SIZES[size]})")
        _report({r: v for r, v in runs[size].items() if v}, args)


def _report(runs: dict[str, list[list[dict]]], args) -> None:
    med = statistics.median
    mib = 2 ** 20
    step = {r: [med(launch[k]["step_s"] for launch in v) for k in range(2)] for r, v in runs.items()}
    ref = "tp2" if "tp2" in runs else next(iter(runs))
    print(f"\n{args.rounds} rounds x {args.steps} steps, median over rounds; load now {_loadavg()}")
    print(f"{'runner':7} {'step s r0':>9} {'step s r1':>9} {'spread':>13} {'vs ' + ref:>7} {'peak RSS MiB r0/r1':>19} "
          f"{'growth MiB r0/r1':>17} {'param MiB':>9} {'expected':>8} {'ratio':>6} {'split':>5}")
    for r, v in runs.items():
        per_launch = [max(launch[k]["step_s"] for k in range(2)) for launch in v]
        peak = [med(launch[k]["peak_rss"] for launch in v) / mib for k in range(2)]
        growth = [med(launch[k]["rss_growth"] for launch in v) / mib for k in range(2)]
        first = v[0][0]
        pb, exp = first["param_bytes"], first["expected_param_bytes"]
        ratio = f"{pb / exp:6.3f}" if exp else "     -"
        print(f"{r:7} {step[r][0]:9.3f} {step[r][1]:9.3f} {min(per_launch):6.3f}-{max(per_launch):.3f} "
              f"{max(step[r]) / max(step[ref]):7.2f} {peak[0]:9.0f}/{peak[1]:<9.0f} {growth[0]:8.0f}/{growth[1]:<8.0f} "
              f"{pb / mib:9.2f} {exp / mib if exp else float('nan'):8.2f} {ratio} "
              f"{first['split_params'] if first['split_params'] is not None else '-':>5}")
    for r, v in runs.items():
        exp = v[0][0]["expected_param_bytes"]
        if exp:
            ratio = v[0][0]["param_bytes"] / exp
            print(f"{r}: parameter bytes per rank / (split / TP + whole) = {ratio:.4f} "
                  f"({'within' if abs(ratio - 1) <= 0.05 else 'OUTSIDE'} 5%)")
    print("hf_zero imported from: " + ", ".join(f"{r} {v[0][0].get('hf_zero')}" for r, v in runs.items()))
    print("first-step loss (same model and data): " + ", ".join(f"{r} {v[0][0]['first_loss']:.4f}"
                                                               for r, v in runs.items()))
    for r in ("tp2", "tp2_base", "tp2_sp"):  # the issue-27 figure; per round: both launched in the same round
        if r in runs and "ds_tp2" in runs:
            pairs = [max(a[k]["step_s"] for k in range(2)) / max(b[k]["step_s"] for k in range(2))
                     for a, b in zip(runs[r], runs["ds_tp2"])]
            cpu = {q: max(med(x[k]["cpu_s"] for x in runs[q]) for k in range(2)) for q in (r, "ds_tp2")}
            print(f"{r} / ds_tp2 step: {max(step[r]) / max(step['ds_tp2']):.2f} (per round "
                  + ", ".join(f"{x:.2f}" for x in pairs) + f"); CPU time per step {cpu[r] / cpu['ds_tp2']:.2f} "
                  + f"({cpu[r]:.3f} / {cpu['ds_tp2']:.3f} s); peak RSS "
                  + f"{max(med(x[k]['peak_rss'] for x in runs[r]) for k in range(2)) / mib:.0f} vs "
                  + f"{max(med(x[k]['peak_rss'] for x in runs['ds_tp2']) for k in range(2)) / mib:.0f} MiB")


if __name__ == "__main__":
    main()
