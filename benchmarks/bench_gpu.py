"""hf_zero on one GPU beside plain torch: the 160M Llama of ../shared/gpu/README.md (bf16, micro-batch 8 x 1024,
AdamW, clipping 1.0), 12 steps per runner, median of steps 5-12, every runner repeated ``--rounds`` times in
interleaved order (torch, FSDP2, z0, z1, z2, z3, z2+offload, torch, ...) so drift of the machine hits all alike.
FSDP2 is torch's fully_shard on one GPU (tests/_gpu_llama.py: fsdp2_run), bf16 compute, fp32 reduction.

    python benchmarks/bench_gpu.py [--rounds 2] [--json OUT.jsonl]

Prints one table: step ms (median over rounds of each round's median), tokens/s, MFU (model FLOPs 6 * params *
tokens + attention, against the H100 SXM's dense bf16 peak of 989 TFLOP/s), max allocated GiB beside what
``hf-zero estimate --accelerator cuda`` predicts for the same configuration, the ratio to the torch loop, and the
final loss of the last round. DeepSpeed 0.19.8's figures on the same GPU (measured on
2026-11-26, ../shared/gpu/README.md) are printed beside them for reference; they were not rerun here (DeepSpeed is
not installed on the GPU image; see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import _gpu_llama as gl  # noqa: E402

PEAK_TFLOPS = 989.0  # H100 SXM, dense bf16
DEEPSPEED_MS = {"z0": 55.0, "z1": 43.6, "z2": 54.3, "z3": 132.0, "z2_offload": 156.4}  # same GPU, one call
DEEPSPEED_GB = {"z0": 7.90, "z1": 7.90, "z2": 7.90, "z3": 9.13, "z2_offload": 6.17}
RUNNERS = [("torch", None, False), ("fsdp2", "fsdp2", False), ("z0", 0, False), ("z1", 1, False), ("z2", 2, False),
           ("z3", 3, False), ("z2_offload", 2, True)]


def model_flops_per_step(numel: int) -> float:
    cfg = gl.llama_config()
    tokens = gl.B * gl.S
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * gl.S * tokens  # QK^T and AV, fwd + bwd
    return 6 * numel * tokens + attention


def predicted_peak_gib(stage: int, offload: bool) -> float:
    """What ``hf-zero estimate --accelerator cuda`` predicts for this runner's peak allocated GPU memory."""
    from hf_zero.profiling.activations import activation_profile
    from hf_zero.profiling.memory import build_meta_model, estimate_memory

    cfg = gl.llama_config()
    act = activation_profile(cfg, 1, gl.S, dtype=torch.bfloat16, gradient_checkpointing=False, trainable=None,
                             lora=None)
    est = estimate_memory(build_meta_model(cfg, None), gl.ds_config(stage, offload), world_size=1, micro_batch=gl.B,
                          seq_len=gl.S, accelerator="cuda", trainable=None, gradient_checkpointing=False,
                          activations=act.scaled(gl.B))
    return est.peak("accelerator") / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated runner names")
    args = ap.parse_args()
    runners = [r for r in RUNNERS if args.only is None or r[0] in args.only.split(",") or r[0] == "torch"]
    results: dict[str, list] = {name: [] for name, _, _ in runners}
    for rnd in range(args.rounds):
        for name, stage, offload in runners:
            try:
                run = (gl.torch_run() if stage is None else gl.fsdp2_run() if stage == "fsdp2" else
                       gl.hf_zero_run(stage, offload))
            except Exception as exc:  # noqa: BLE001 -- a failing runner is a row, not the end of the table
                results[name].append({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(f"round {rnd} {name}: FAILED {exc!r}"[:400], flush=True)
                continue
            row = {"round": rnd, "step_ms": 1e3 * run.median_step_s, "max_alloc_gb": run.max_alloc / 2**30,
                   "losses": [round(x, 4) for x in run.losses], "numel": run.numel}
            results[name].append(row)
            print(f"round {rnd} {name}: {row['step_ms']:.1f} ms, {row['max_alloc_gb']:.2f} GiB, "
                  f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"runner": name, **row}) + "\n")
    ok = {n: [r for r in rows if "error" not in r] for n, rows in results.items()}
    torch_ms = statistics.median(r["step_ms"] for r in ok["torch"]) if ok["torch"] else float("nan")
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.rounds} interleaved rounds | "
          f"160M Llama bf16, B{gl.B}xS{gl.S}, 12 steps, median of steps 5-12")
    print(f"{'runner':<12} {'step ms':>8} {'x torch':>8} {'tokens/s':>9} {'MFU':>6} {'max GiB':>8} "
          f"{'est GiB':>8} {'DS ms':>7} {'x DS':>6} {'DS GiB':>7} {'last loss':>9}")
    stages = {name: (stage, offload) for name, stage, offload in runners}
    for name, rows in ok.items():
        if not rows:
            print(f"{name:<12} FAILED: {results[name][-1]['error']}")
            continue
        ms = statistics.median(r["step_ms"] for r in rows)
        gb = max(r["max_alloc_gb"] for r in rows)
        mfu = model_flops_per_step(rows[-1]["numel"]) / (ms / 1e3) / (PEAK_TFLOPS * 1e12)
        ds = DEEPSPEED_MS.get(name)
        stage, offload = stages[name]
        est = f"{predicted_peak_gib(stage, offload):.2f}" if isinstance(stage, int) else ""
        print(f"{name:<12} {ms:8.1f} {ms / torch_ms:8.2f} {gl.B * gl.S / (ms / 1e3):9.0f} {mfu:6.1%} {gb:8.2f} "
              f"{est:>8} {ds if ds else '':>7} {(f'{ms / ds:.2f}' if ds else ''):>6} {DEEPSPEED_GB.get(name, ''):>7} "
              f"{rows[-1]['losses'][-1]:9.4f}")


if __name__ == "__main__":
    main()
