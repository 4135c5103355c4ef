"""RLHF rollouts under ZeRO-3: ``module.generate`` with and without ``hybrid_engine``, hf_zero and DeepSpeed, 2 CPU ranks.

    python benchmarks/bench_hybrid_generate.py --repeats 3
    python benchmarks/bench_hybrid_generate.py --runners hf_zero_z3,hf_zero_z3_hybrid --repeats 1

What DeepSpeed-Chat's step 3 does with the actor between PPO steps, on the same OPT (built from config, fp32):
``engine.eval()``, ``engine.module.generate(prompts, max_new_tokens=N, do_sample=False, synced_gpus=True)``,
``engine.train()``, one training step. Runners: ``*_z3`` plain ZeRO-3 (every layer gathered at every decoding step),
``*_z3_hybrid`` with ``"hybrid_engine": {"enabled": true}`` (DeepSpeed's ``DeepSpeedHybridEngine``; for OPT under
transformers >= 4.56 it has no inference policy and generates with the model's own forward, as it logs; hf_zero
gathers the model once per call), ``*_z2`` ZeRO-2 (nothing to gather: the floor). DeepSpeed runs from its own
virtual environment (``--ds-python``, ``DS_ACCELERATOR=cpu``). ``--site`` puts a directory first on both engines'
``PYTHONPATH``: with transformers 5, DeepSpeed 0.19.8's hybrid engine takes OPT's decoder layer for one it has
inference kernels for and fails on the CPU ("This op had not been implemented on CPU backend"); with transformers
4.57 (DeepSpeed-Chat's, docs/deepspeed_chat.md) it generates with the model's own forward.

Runners go interleaved (A B C .. A B C ..), ``--repeats`` rounds; per launch the median over ``--rounds`` rollout
rounds after one warm-up round of the generate time and the training step time (the slower rank's), and the tokens
generated (every runner must produce the same ones: the greedy continuation of the same weights). Ratios are taken
within a round, then their median and range printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNNERS = ["deepspeed_z2", "deepspeed_z3", "deepspeed_z3_hybrid", "hf_zero_z2", "hf_zero_z3", "hf_zero_z3_hybrid"]
MODEL = dict(vocab_size=4096, hidden_size=256, ffn_dim=1024, num_hidden_layers=6, num_attention_heads=8,
             max_position_embeddings=256, word_embed_proj_dim=256, dropout=0.0)
BATCH, PROMPT = 4, 16


def _config(runner: str) -> dict:
    stage = 3 if "_z3" in runner else 2
    zero = {"stage": stage, "overlap_comm": True}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned, as a large actor's would be
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "zero_optimization": zero,
           "steps_per_print": 10 ** 9}
    if runner.endswith("_hybrid"):
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": 256}
    return cfg


def worker(runner: str, new_tokens: int, rounds: int, out_dir: str) -> None:
    """One rank of one runner (under torchrun); writes its timings and a digest of its tokens as JSON."""
    import logging

    import torch
    import torch.distributed as dist
    from transformers import OPTConfig, OPTForCausalLM

    import deepspeed

    logging.getLogger("hf_zero").setLevel(logging.WARNING)  # the hybrid engine's per-round line
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(**MODEL))
    n_params = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=_config(runner))
    g = torch.Generator().manual_seed(100 + rank)
    gen_s, train_s, digests = [], [], []
    for round_ in range(rounds + 1):
        prompts = torch.randint(4, MODEL["vocab_size"], (BATCH, PROMPT), generator=g)
        engine.eval()
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            seq = engine.module.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=1,
                                         synced_gpus=True)
        generated = time.perf_counter() - start
        engine.train()
        start = time.perf_counter()
        loss = engine(input_ids=seq, labels=seq).loss
        engine.backward(loss)
        engine.step()
        trained = time.perf_counter() - start
        if round_ > 0:  # round 0 warms up
            gen_s.append(generated)
            train_s.append(trained)
        digests.append(hashlib.sha1(seq.numpy().tobytes()).hexdigest()[:12])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"generate_s": statistics.median(gen_s), "train_s": statistics.median(train_s), "tokens": digests,
         "n_params": n_params, "loss": loss.item()}))


def _launch(runner: str, args, out_dir: str) -> str | None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.site, env.get("PYTHONPATH")]))
    python = sys.executable
    if runner.startswith("deepspeed"):
        if not args.ds_python or not Path(args.ds_python).exists():
            return f"skipped: no DeepSpeed python ({args.ds_python})"
        python = args.ds_python
        env.update(DS_ACCELERATOR="cpu", HF_ZERO_DISABLE_DEEPSPEED_SHIM="1")
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(args.port),
           __file__, "--worker", runner, "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds),
           "--out", out_dir]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return f"failed (rc {done.returncode}): {(done.stderr.strip().splitlines() or [done.stdout[-300:]])[-1]}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rollout rounds per launch (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    parser.add_argument("--port", type=int, default=29571)
    parser.add_argument("--site", help="a directory put first on both engines' PYTHONPATH (e.g. transformers 4.57: "
                        "with transformers 5 DeepSpeed's hybrid engine takes OPT for a model it has kernels for and "
                        "fails on the CPU, 'This op had not been implemented on CPU backend')")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.new_tokens, args.rounds, args.out)
        return

    runners = args.runners.split(",")
    rows: list[dict[str, dict]] = []
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            row = {}
            for runner in runners:
                out = Path(root, f"{repeat}_{runner}")
                out.mkdir()
                note = _launch(runner, args, str(out))
                if note:
                    notes[runner] = note
                    continue
                ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
                row[runner] = {"generate_s": max(r["generate_s"] for r in ranks),
                               "train_s": max(r["train_s"] for r in ranks),
                               "tokens": [r["tokens"] for r in ranks], "n_params": ranks[0]["n_params"],
                               "loss": ranks[0]["loss"]}
                print(f"round {repeat + 1} {runner}: generate {row[runner]['generate_s'] * 1e3:.0f} ms, "
                      f"train step {row[runner]['train_s'] * 1e3:.0f} ms", flush=True)
            rows.append(row)

    load = os.getloadavg()
    any_row = next(r for row in rows for r in row.values())
    print(f"\nOPT ({any_row['n_params'] / 1e6:.2f}M params, fp32), {BATCH} prompts x {PROMPT} tokens per rank, "
          f"{args.new_tokens} new tokens, greedy, synced_gpus; 2 gloo ranks x 1 thread; {args.repeats} interleaved "
          f"launches x {args.rounds} timed rounds; load average at the end {load[0]:.2f}\n")
    print("| runner | generate ms (median) | x its engine's plain ZeRO-3 | x DeepSpeed same mode | train step ms "
          "| tokens as hf_zero_z2's |")
    print("|---|---|---|---|---|---|")

    def ratios(a: str, b: str, key: str = "generate_s") -> list[float]:
        return [row[a][key] / row[b][key] for row in rows if a in row and b in row]

    def fmt(rs: list[float]) -> str:
        return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})" if rs else ""

    reference = next((row["hf_zero_z2"]["tokens"] for row in rows if "hf_zero_z2" in row), None)
    for runner in runners:
        got = [row[runner] for row in rows if runner in row]
        if not got:
            print(f"| {runner} | {notes.get(runner, 'no result')} | | | | |")
            continue
        engine = "hf_zero" if runner.startswith("hf_zero") else "deepspeed"
        vs_plain = fmt(ratios(runner, f"{engine}_z3")) if runner != f"{engine}_z3" else ""
        vs_ds = fmt(ratios(runner, runner.replace("hf_zero", "deepspeed"))) if runner.startswith("hf_zero") else ""
        same = "" if reference is None else ("yes" if all(r["tokens"] == reference for r in got) else "NO")
        print(f"| {runner} | {statistics.median(r['generate_s'] for r in got) * 1e3:.0f} | {vs_plain} | {vs_ds} | "
              f"{statistics.median(r['train_s'] for r in got) * 1e3:.0f} | {same} |")


if __name__ == "__main__":
    main()
