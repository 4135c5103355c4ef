"""torch.compile on a ZeRO engine: hf_zero and DeepSpeed, eager and compiled, beside DDP, on 2 CPU processes.

    python benchmarks/bench_compile.py --size tiny --repeats 3
    python benchmarks/bench_compile.py --runners hf_zero_z3,hf_zero_z3_compiled --repeats 1

Every runner trains the same Llama (built from config) on the same token batches: AdamW, clipping 1.0, fp32, one
optimizer step per micro-batch, 2 gloo ranks launched with torchrun (DeepSpeed from its own virtual environment,
``--ds-python``, ``DS_ACCELERATOR=cpu``). ``_compiled`` runners call ``engine.compile()`` (inductor, its default)
after ``initialize`` -- what accelerate does for ``TrainingArguments(torch_compile=True)`` on both engines; DDP's
is ``torch.compile(model)`` before wrapping. ``*_z3_leaves_compiled`` also mark the decoder layers as ZeRO-3
leaf modules (``deepspeed.utils.set_z3_leaf_modules``, the same call on both engines): each layer is gathered as one
unit and compiled as one graph instead of breaking at every linear layer.

Runners go interleaved (A B C .. A B C ..), ``--repeats`` rounds; per launch the median step time over the steps
after ``--warmup`` (compilation happens in the warm-up steps and is reported apart: the first step's time), and the
loss at the last step (eager and compiled runs of one engine must agree). Ratios are taken within a round, then
their median and range printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNNERS = ["ddp", "ddp_compiled", "deepspeed_z3", "deepspeed_z3_compiled", "deepspeed_z3_leaves_compiled",
           "hf_zero_z2", "hf_zero_z2_compiled", "hf_zero_z3", "hf_zero_z3_compiled", "hf_zero_z3_leaves_compiled"]
SIZES = {
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4),
    "32m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4),
}
MICRO, SEQ, LR = 4, 128, 1e-4


def _config(stage: int) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned: hooks on every module
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": zero, "steps_per_print": 10 ** 9}


def worker(runner: str, size: str, steps: int, warmup: int, out_dir: str) -> None:
    """One rank of one runner (under torchrun); writes its step times and losses as JSON."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    vocab = SIZES[size]["vocab_size"]
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, vocab, (MICRO, SEQ), generator=g) for _ in range(steps)]
    compiled = runner.endswith("_compiled")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES[size], max_position_embeddings=SEQ))

    if runner.startswith(("hf_zero", "deepspeed")):
        import deepspeed  # hf_zero's shim in this python, DeepSpeed in --ds-python

        stage = 3 if "_z3" in runner else 2
        if runner.startswith("hf_zero"):
            import hf_zero

            initialize = hf_zero.initialize
        else:
            initialize = deepspeed.initialize
            deepspeed.init_distributed(dist_backend="gloo")
        if "_leaves" in runner:
            from deepspeed.utils import set_z3_leaf_modules
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer

            set_z3_leaf_modules(model, [LlamaDecoderLayer])
        engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
        if compiled:
            engine.compile()

        def train_step(ids) -> float:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss.item()
    else:
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        wrapped = DistributedDataParallel(model)
        called = torch.compile(wrapped) if compiled else wrapped
        opt = torch.optim.AdamW(wrapped.parameters(), lr=LR, weight_decay=0.01)

        def train_step(ids) -> float:
            loss = called(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

    times, losses = [], []
    for ids in batches:
        dist.barrier()
        start = time.perf_counter()
        losses.append(train_step(ids))
        times.append(time.perf_counter() - start)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "runner": runner, "step_s": statistics.median(times[warmup:]), "first_step_s": times[0],
        "last_loss": losses[-1], "n_params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())}))


def _launch(runner: str, args, out_dir: str) -> str | None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    python = sys.executable
    if runner.startswith("deepspeed"):
        if not args.ds_python or not Path(args.ds_python).exists():
            return f"skipped: no DeepSpeed python ({args.ds_python})"
        python = args.ds_python
        env.update(DS_ACCELERATOR="cpu", HF_ZERO_DISABLE_DEEPSPEED_SHIM="1")
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(args.port),
           __file__, "--worker", runner, "--size", args.size, "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--out", out_dir]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return f"failed (rc {done.returncode}): {done.stderr.strip().splitlines()[-1:] or done.stdout[-300:]}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median (compilation)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.size, args.steps, args.warmup, args.out)
        return

    runners = args.runners.split(",")
    rounds: list[dict[str, dict]] = []
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as root:
        for round_ in range(args.repeats):
            row = {}
            for runner in runners:
                out = Path(root, f"{round_}_{runner}")
                out.mkdir()
                note = _launch(runner, args, str(out))
                if note:
                    notes[runner] = note
                    continue
                ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
                row[runner] = {"step_s": max(r["step_s"] for r in ranks),  # the slower rank sets the pace
                               "first_step_s": max(r["first_step_s"] for r in ranks),
                               "last_loss": ranks[0]["last_loss"], "n_params": ranks[0]["n_params"]}
                print(f"round {round_ + 1} {runner}: {row[runner]['step_s'] * 1e3:.1f} ms/step", flush=True)
            rounds.append(row)

    load = os.getloadavg()
    any_row = next(r for row in rounds for r in row.values())
    print(f"\n{args.size} Llama ({any_row['n_params'] / 1e6:.2f}M params), micro-batch {MICRO}x{SEQ}, 2 gloo "
          f"ranks x 1 thread, fp32, {args.repeats} interleaved rounds x {args.steps} steps (median of steps "
          f"{args.warmup + 1}..), load average at the end {load[0]:.2f}\n")
    print("| runner | step ms (median of rounds) | x its eager run (median, range) | x DeepSpeed ZeRO-3 same mode "
          "| first step s | loss at last step |")
    print("|---|---|---|---|---|---|")

    def eager_of(runner: str) -> str:
        return runner.replace("_leaves", "").replace("_compiled", "")

    def ratios(a: str, b: str) -> list[float]:
        return [row[a]["step_s"] / row[b]["step_s"] for row in rounds if a in row and b in row]

    def fmt(rs: list[float]) -> str:
        return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})" if rs else ""

    for runner in runners:
        rows = [row[runner] for row in rounds if runner in row]
        if not rows:
            print(f"| {runner} | {notes.get(runner, 'no result')} | | | | |")
            continue
        ds_peer = runner.replace("hf_zero", "deepspeed")
        vs_ds = fmt(ratios(runner, ds_peer)) if "_z3" in runner and not runner.startswith("deepspeed") else ""
        vs_eager = fmt(ratios(runner, eager_of(runner))) if runner != eager_of(runner) else ""
        print(f"| {runner} | {statistics.median(r['step_s'] for r in rows) * 1e3:.1f} | {vs_eager} | {vs_ds} | "
              f"{statistics.median(r['first_step_s'] for r in rows):.1f} | {rows[-1]['last_loss']:.4f} |")


if __name__ == "__main__":
    main()
