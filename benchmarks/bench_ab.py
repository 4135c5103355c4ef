"""Two hf_zero trees side by side: the same ZeRO training steps under each, interleaved round by round.

    git worktree add --detach /tmp/base <commit>
    python benchmarks/bench_ab.py --base /tmp/base --stages 1,2,3 --rounds 4

Each round launches, per ZeRO stage, this script's worker once under ``--base`` and once under this checkout (the
order alternating between rounds), on 2 processes with ``PYTHONPATH`` pointing at the tree, so a slow spell of a
shared machine hits both sides alike. The worker trains bench_zero.py's Llama (bf16 compute, fp32 masters, AdamW,
clipping) and records per step the wall time and the process CPU time: on a machine loaded by other work the wall
time mostly measures the load, while the CPU time a rank spends on its own step (one thread per rank) measures the
code. Reported per stage and tree: medians over rounds of the per-launch median step (wall, CPU), the largest
peak-RSS growth of a rank, the exact model-state bytes, and the ratio this / base with the range of the per-round
ratios -- the noise a difference has to exceed.
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

HERE = Path(__file__).resolve().parents[1]
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256)
MICRO, SEQ = 4, 128


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(stage: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    torch.set_num_threads(1)
    baseline = _rss_bytes()
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=g) for _ in range(steps)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 5e7,
                                    "allgather_bucket_size": 5e7, "stage3_param_persistence_threshold": 0},
              "steps_per_print": 10 ** 9}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    wall, cpu, loss = [], [], None
    for ids in batches:
        dist.barrier()
        w, c = time.perf_counter(), time.process_time()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    state = sum(t.numel() * t.element_size() for grp in engine.groups
                for t in [grp.master, grp.grad, *engine.optimizer.state[grp.master].values()] if t.numel() > 1)
    result = {"wall_s": statistics.median(wall[2:]), "cpu_s": statistics.median(cpu[2:]),
              "rss": _rss_bytes() - baseline, "state_bytes": state, "loss": float(loss)}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def _launch(tree: Path, stage: int, steps: int, out: Path) -> dict:
    from hf_zero.comm.process_group import free_port

    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, "--worker", str(stage), "--steps", str(steps), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=str(tree))
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"stage {stage} under {tree} failed (exit {proc.returncode}):\n{tail}")
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    return {k: max(r[k] for r in ranks) for k in ("wall_s", "cpu_s", "rss")} | \
        {"state_bytes": ranks[0]["state_bytes"], "loss": ranks[0]["loss"]}


def _ratio(this: list[dict], base: list[dict], key: str) -> str:
    ratios = [t[key] / b[key] for t, b in zip(this, base)]
    return f"{statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--base", help="the other hf_zero checkout (e.g. a git worktree of the previous head)")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.out)
        return
    if not args.base:
        parser.error("--base is required")
    trees = {"base": Path(args.base).resolve(), "this": HERE}
    stages = [int(s) for s in args.stages.split(",")]
    results = {(s, t): [] for s in stages for t in trees}
    work = Path(tempfile.mkdtemp(prefix="bench_ab_"))
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
        for stage in stages:
            for name in order:
                got = _launch(trees[name], stage, args.steps, work / f"{rnd}-{name}-z{stage}")
                results[(stage, name)].append(got)
                print(f"round {rnd} z{stage} {name:4s} wall {1000 * got['wall_s']:7.1f} ms  cpu "
                      f"{1000 * got['cpu_s']:7.1f} ms  peak RSS growth {got['rss'] / 2**20:7.1f} MB  "
                      f"loss {got['loss']:.6f}", flush=True)
    print(f"\n{'stage':5s} {'cpu ms base':>11s} {'this':>7s} {'cpu this/base':>20s} {'wall this/base':>20s} "
          f"{'RSS MB base':>11s} {'this':>7s} {'RSS this/base':>20s} {'state bytes base=this':>22s}")
    for stage in stages:
        b, t = results[(stage, "base")], results[(stage, "this")]
        med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
        same = "yes" if all(x["state_bytes"] == y["state_bytes"] for x, y in zip(b, t)) else "NO"
        print(f"z{stage:<4d} {1000 * med(b, 'cpu_s'):11.1f} {1000 * med(t, 'cpu_s'):7.1f} {_ratio(t, b, 'cpu_s'):>20s} "
              f"{_ratio(t, b, 'wall_s'):>20s} {med(b, 'rss') / 2**20:11.1f} {med(t, 'rss') / 2**20:7.1f} "
              f"{_ratio(t, b, 'rss'):>20s} {str(b[0]['state_bytes']) + ' ' + same:>22s}")


if __name__ == "__main__":
    main()
