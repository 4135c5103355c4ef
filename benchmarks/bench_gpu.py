"""hf_zero on one GPU beside plain torch: the 160M Llama of ../shared/gpu/README.md (bf16, micro-batch 8 x 1024,
AdamW, clipping 1.0), 12 steps per runner, median of steps 5-12, every runner repeated ``--rounds`` times in
interleaved order (torch, FSDP2, z0, z1, z2, z3, z2+offload, torch, ...) so drift of the machine hits all alike.
FSDP2 is torch's fully_shard on one GPU (tests/_gpu_llama.py: fsdp2_run), bf16 compute, fp32 reduction.

    python benchmarks/bench_gpu.py [--rounds 2] [--json OUT.jsonl] [--deepspeed-path DIRS]
    python benchmarks/bench_gpu.py --rounds 1 --only torch,z0,z3 --compiled   # each also compiled (inductor)

Prints one table: step ms (median over rounds of each round's median), tokens/s, MFU (model FLOPs 6 * params *
tokens + attention, against the H100 SXM's dense bf16 peak of 989 TFLOP/s), max allocated GiB beside what
``hf-zero estimate --accelerator cuda`` predicts for the same configuration, the ratio to the torch loop, and the
final loss of the last round. DeepSpeed's figures beside them: with ``--deepspeed-path DIRS`` (a real DeepSpeed,
installed from carried wheels by scripts/gpu_check.sh's ds_install step) its ZeRO-0..3 and ZeRO-2 + CPU offload run
in the same rounds, each in its own process (benchmarks/_ds_gpu_run.py); without it, DeepSpeed 0.19.8's figures
measured earlier on the same GPU (../shared/gpu/README.md), marked *.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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


_NUMEL: list[int] = []


def gl_numel() -> int:
    """The model's parameter count (for a runner that does not report it: DeepSpeed's process)."""
    if not _NUMEL:
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            _NUMEL.append(sum(p.numel() for p in LlamaForCausalLM(gl.llama_config()).parameters()))
    return _NUMEL[0]


def deepspeed_run(name: str, pythonpath: str, port: int) -> gl.Run:
    """DeepSpeed's runner ``name`` (z0..z3, z2_offload) in its own process (benchmarks/_ds_gpu_run.py)."""
    env = dict(os.environ, HF_ZERO_DISABLE_DEEPSPEED_SHIM="1", DS_BUILD_OPS="0",
               PYTHONPATH=pythonpath + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ds_gpu_run.py")
    out = subprocess.run([sys.executable, script, name, str(port)], env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"DeepSpeed {name} exited {out.returncode}: {(out.stderr or out.stdout)[-600:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    run = gl.Run(f"deepspeed_{name}", losses=res["losses"], step_s=res["step_s"], max_alloc=res["max_alloc"])
    run.info["version"] = res["deepspeed"]
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated runner names")
    ap.add_argument("--compiled", action="store_true",
                    help="also run each selected runner (torch and the hf_zero stages) compiled: model.compile() / "
                         "engine.compile(), inductor; the first steps compile and are outside the median")
    ap.add_argument("--deepspeed-path", default=None,
                    help="PYTHONPATH entries holding a real DeepSpeed (scripts/gpu_check.sh's ds_install step): its "
                         "ZeRO-0..3 and ZeRO-2 + CPU offload run in the same rounds, each in its own process")
    args = ap.parse_args()
    runners = [r for r in RUNNERS if args.only is None or r[0] in args.only.split(",") or r[0] == "torch"]
    if args.compiled:
        runners += [(f"{name}_compiled", stage, offload) for name, stage, offload in runners
                    if stage is None or isinstance(stage, int)]
    if args.deepspeed_path:
        runners += [(f"ds_{name}", ("ds", name), False) for name, stage, _ in runners if isinstance(stage, int)]
    results: dict[str, list] = {name: [] for name, _, _ in runners}
    for rnd in range(args.rounds):
        for name, stage, offload in runners:
            try:
                if isinstance(stage, tuple):
                    run = deepspeed_run(stage[1], args.deepspeed_path, 29700 + rnd * 10 + len(results[name]))
                else:
                    compiled = name.endswith("_compiled")
                    run = (gl.torch_run(compiled=compiled) if stage is None else gl.fsdp2_run() if stage == "fsdp2"
                           else gl.hf_zero_run(stage, offload, compiled=compiled))
            except Exception as exc:  # noqa: BLE001 -- a failing runner is a row, not the end of the table
                results[name].append({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(f"round {rnd} {name}: FAILED {exc!r}"[:400], flush=True)
                continue
            row = {"round": rnd, "step_ms": 1e3 * run.median_step_s, "max_alloc_gb": run.max_alloc / 2**30,
                   "losses": [round(x, 4) for x in run.losses], "numel": run.numel or gl_numel()}
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
        stage, offload = stages[name]
        est = f"{predicted_peak_gib(stage, offload):.2f}" if isinstance(stage, int) else ""
        # DeepSpeed's figures: measured in these rounds when --deepspeed-path was given, else ../shared/gpu/README.md's
        # (marked *)
        measured = ok.get(f"ds_{name}") or []
        if measured:
            ds = f"{statistics.median(r['step_ms'] for r in measured):.1f}"
            ds_gb = f"{max(r['max_alloc_gb'] for r in measured):.2f}"
        else:
            ds = f"{DEEPSPEED_MS[name]}*" if name in DEEPSPEED_MS else ""
            ds_gb = f"{DEEPSPEED_GB[name]}*" if name in DEEPSPEED_GB else ""
        ratio = f"{ms / float(ds.rstrip('*')):.2f}" if ds else ""
        print(f"{name:<12} {ms:8.1f} {ms / torch_ms:8.2f} {gl.B * gl.S / (ms / 1e3):9.0f} {mfu:6.1%} {gb:8.2f} "
              f"{est:>8} {ds:>7} {ratio:>6} {ds_gb:>7} {rows[-1]['losses'][-1]:9.4f}")
    if not any(n.startswith("ds_") for n in ok):
        print("* DeepSpeed 0.19.8 on the same GPU and model, measured earlier (../shared/gpu/README.md); "
              "--deepspeed-path runs it in the same rounds")


if __name__ == "__main__":
    main()
