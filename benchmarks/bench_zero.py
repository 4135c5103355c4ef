"""hf_zero ZeRO stages vs DDP, FSDP2 and DeepSpeed, side by side, interleaved, on 2 CPU processes.

    python benchmarks/bench_zero.py --size 32m --repeats 3          # the issue-15 comparison (32M Llama, fp32)
    python benchmarks/bench_zero.py --size 125m --repeats 2 --steps 8
    python benchmarks/bench_zero.py --size tiny --runners hf_zero_z2,ddp

Every runner trains the same Llama (built from config) on the same token batches, AdamW, gradient clipping 1.0,
one optimizer step per micro-batch, launched with torchrun (DeepSpeed from its own virtual environment,
``--ds-python``, since hf_zero answers ``import deepspeed`` where DeepSpeed is absent; ``DS_ACCELERATOR=cpu``).
Runners are launched interleaved (A B C .. A B C ..), ``--repeats`` times, so a slow minute of a shared machine hits
every runner alike; ratios are taken between launches of the same round, then their median and range reported.

Per launch and rank: median step time (steps after the first two), the split of a step into forward, backward and
optimizer step (what the calling loop sees, collectives waited inside them included), for hf_zero the time blocked
in collectives (``communication``: reduce-scatter/gather waits not hidden behind compute), the peak RSS of the
process (VmHWM) and the peak RSS of each phase of the last step (the kernel's high-water mark is reset between
phases through /proc/self/clear_refs), and for hf_zero the model-state bytes per parameter against the ZeRO
formulas (mixed precision: Z1 4+12/N, Z2 2+14/N, Z3 16/N; fp32: Z1 8+8/N, Z2 4+12/N, Z3 16/N). Also per step: the
process's CPU time (all threads; far less inflated by a loaded machine than wall time) and its page faults per
phase (each first touch of freshly mmapped memory; docs/zero_memory.md). ``HF_ZERO_HOST_MALLOC=<bytes>|default``
picks hf_zero's mmap threshold; ``BENCH_TRIM=1`` makes the hf_zero runners call ``malloc_trim(0)`` after each step.
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

RUNNERS = ["ddp", "fsdp2", "deepspeed_z2", "deepspeed_z3", "hf_zero_z1", "hf_zero_z2", "hf_zero_z3"]
SIZES = {
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4),
    "32m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4),
    "125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}
MICRO, SEQ, LR = 4, 128, 1e-4
PHASES = ("forward", "backward", "step")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _minor_faults() -> int:
    """Page faults of this process so far: every first touch of freshly mapped memory is one (4 KiB each)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _ds_config(stage: int, bf16: bool) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": zero, "steps_per_print": 10 ** 9}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _model(size: str, ds_stage3_config: dict | None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=SEQ)
    if ds_stage3_config is None:
        return LlamaForCausalLM(config)
    import deepspeed  # hf_zero's or DeepSpeed's zero.Init: stage 3 builds the model partitioned

    with deepspeed.zero.Init(config_dict_or_path=ds_stage3_config):
        return LlamaForCausalLM(config)


def _engine_state_bytes(engine) -> int:
    """hf_zero: bytes of every distinct storage held for parameters, shards, gradients and optimizer states."""
    import torch

    tensors = []
    for p in engine.module.parameters():
        tensors += [p.data, p.grad]
    for g in engine.groups:
        tensors += [g.master, g.grad, g.param16]
    for state in engine.optimizer.state.values():
        tensors += [t for t in state.values() if torch.is_tensor(t) and t.numel() > 1]
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def worker(runner: str, size: str, dtype: str, steps: int, out_dir: str, profile: bool = False) -> None:
    """One rank of one runner (under torchrun). Writes its measurements as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import transformers  # noqa: F401  (imported before the baseline, by every runner alike)

    baseline_kb = _status_kb("VmRSS")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    vocab = SIZES[size]["vocab_size"]
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, vocab, (MICRO, SEQ), generator=g) for _ in range(steps)]
    bf16 = dtype == "bf16"
    stage = int(runner[-1]) if runner[-1].isdigit() else None
    timers = None
    state_bytes = None

    if runner.startswith(("hf_zero", "deepspeed")):
        import deepspeed  # hf_zero's shim in the system python, DeepSpeed in --ds-python

        if runner.startswith("hf_zero"):
            import hf_zero

            init = hf_zero.initialize
        else:
            init = deepspeed.initialize
            if stage == 3:
                deepspeed.init_distributed(dist_backend="gloo")
        cfg = _ds_config(stage, bf16)
        if runner.startswith("hf_zero"):
            cfg.update(json.loads(os.environ.get("BENCH_HF_ZERO_EXTRA", "{}")))
        if runner.startswith("hf_zero") and stage == 3:
            hf_zero.init_distributed(dist_backend="gloo")
        model = _model(size, cfg if stage == 3 else None)
        built_kb = _status_kb("VmRSS")
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
        if runner.startswith("hf_zero"):
            from hf_zero.profiling.timers import PhaseTimers

            timers = PhaseTimers(True)
            engine.timers = timers

        def forward(ids):
            return engine(input_ids=ids, labels=ids).loss

        def backward(loss):
            engine.backward(loss)

        def step():
            engine.step()
            if os.environ.get("BENCH_TRIM"):
                import ctypes

                ctypes.CDLL("libc.so.6").malloc_trim(0)
    else:
        model = _model(size, None)
        built_kb = _status_kb("VmRSS")
        dist.init_process_group("gloo")
        if runner == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else \
                MixedPrecisionPolicy()
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp)
            wrapped = fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=LR, weight_decay=0.01)

        def forward(ids):
            if runner == "ddp" and bf16:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return wrapped(input_ids=ids, labels=ids).loss
            return wrapped(input_ids=ids, labels=ids).loss

        def backward(loss):
            loss.backward()

        def step():
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    init_kb = _status_kb("VmRSS")

    rows, losses = [], []
    profiler = None
    for i, ids in enumerate(batches):
        last = i == len(batches) - 1
        dist.barrier()
        row = {}
        if last:
            before_last_kb = _status_kb("VmHWM")  # the peak so far; the resets below start a window per phase
            _reset_peak()
        if profile and i == len(batches) - 2:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        f0 = _minor_faults()
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = forward(ids)
        t1 = time.perf_counter()
        f1 = _minor_faults()
        if last:
            row["peak_forward_kb"] = _status_kb("VmHWM")
            _reset_peak()
        backward(loss)
        t2 = time.perf_counter()
        f2 = _minor_faults()
        if last:
            row["peak_backward_kb"] = _status_kb("VmHWM")
            _reset_peak()
        step()
        t3 = time.perf_counter()
        f3 = _minor_faults()
        c3 = time.process_time()
        if last:
            row["peak_step_kb"] = _status_kb("VmHWM")
        row.update(forward=t1 - t0, backward=t2 - t1, step=t3 - t2, total=t3 - t0, faults_forward=f1 - f0,
                   faults_backward=f2 - f1, faults_step=f3 - f2, cpu=c3 - c0)
        if profiler is not None and i == len(batches) - 2:
            profiler.__exit__(None, None, None)
        if timers is not None:
            row["communication"] = timers.reset().get("communication", 0.0)
        rows.append(row)
        losses.append(float(loss.detach().float()))
        if runner.startswith("hf_zero") and i == 1:
            state_bytes = _engine_state_bytes(engine)
    warm = rows[2:] if len(rows) > 4 else rows
    keys = ["total", "cpu", *PHASES, *(f"faults_{p}" for p in PHASES)]
    keys += ["communication"] if timers is not None else []
    result = {"runner": runner, "rank": rank, "world": world, "n_params": n_params,
              "median": {k: statistics.median(r[k] for r in warm) for k in keys},
              "peak_kb": max(before_last_kb, *(rows[-1][f"peak_{p}_kb"] for p in PHASES)),
              "baseline_kb": baseline_kb, "built_kb": built_kb, "init_kb": init_kb,
              "phase_peak_kb": {p: rows[-1][f"peak_{p}_kb"] for p in PHASES},
              "state_bytes": state_bytes, "first_loss": losses[0], "last_loss": losses[-1]}
    if profiler is not None:  # the second-to-last step, op by op (self CPU time, this rank's thread)
        result["ops"] = [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in
                         sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]]
    Path(out_dir, f"{runner}.{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def _launch(runner: str, args, out_dir: str) -> str | None:
    python = sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_HF_ZERO_EXTRA=args.hf_extra)
    if runner.startswith("deepspeed"):
        if not args.ds_python or not Path(args.ds_python).exists():
            return f"skipped: no DeepSpeed python ({args.ds_python})"
        python = args.ds_python
        env["DS_ACCELERATOR"] = "cpu"
        env["HF_ZERO_DISABLE_DEEPSPEED_SHIM"] = "1"
    from hf_zero.comm.process_group import free_port

    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, "--worker", runner, "--size", args.size, "--dtype", args.dtype, "--steps", str(args.steps),
           "--out", out_dir] + (["--profile"] if args.profile else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        return f"failed (exit {proc.returncode}):\n{tail}"
    return None


def _load(out_dir: str) -> dict:
    """{runner: [launch result, ...]}: a launch's time is its slower rank's, its memory its larger rank's."""
    by_launch = {}
    for f in Path(out_dir).glob("*/*.json"):
        r = json.loads(f.read_text())
        by_launch.setdefault((f.parent.name, r["runner"]), []).append(r)
    out = {}
    for (round_, runner), ranks in sorted(by_launch.items()):
        slow = max(ranks, key=lambda r: r["median"]["total"])
        big = max(ranks, key=lambda r: r["peak_kb"])
        out.setdefault(runner, []).append(dict(
            round=round_, median=slow["median"], peak_mb=big["peak_kb"] / 1024,
            baseline_mb=big["baseline_kb"] / 1024, init_mb=big["init_kb"] / 1024,
            built_mb=big["built_kb"] / 1024, phase_mb={p: v / 1024 for p, v in big["phase_peak_kb"].items()},
            n_params=ranks[0]["n_params"], state_bytes=ranks[0]["state_bytes"], ops=slow.get("ops"),
            loss=(ranks[0]["first_loss"], ranks[0]["last_loss"])))
    return out


def _paired(rows: dict, a: str, b: str, key) -> tuple[float, float, float] | None:
    """Median, min, max over rounds of a/b, each from the same round (adjacent launches)."""
    ra = {r["round"]: key(r) for r in rows.get(a, [])}
    rb = {r["round"]: key(r) for r in rows.get(b, [])}
    ratios = [ra[k] / rb[k] for k in ra if k in rb and rb[k]]
    if not ratios:
        return None
    return statistics.median(ratios), min(ratios), max(ratios)


def _fmt_ratio(x) -> str:
    return "-" if x is None else f"{x[0]:.2f} ({x[1]:.2f}-{x[2]:.2f})"


def report(rows: dict, args, notes: dict) -> None:
    any_row = next(iter(rows.values()))[0]
    world = 2
    if args.dtype == "bf16":
        formulas = {1: 4 + 12 / world, 2: 2 + 14 / world, 3: 16 / world}
    else:
        formulas = {1: 8 + 8 / world, 2: 4 + 12 / world, 3: 16 / world}
    m = SIZES[args.size]
    print(f"\nLlama {m['hidden_size']}h x {m['num_hidden_layers']}L, vocab {m['vocab_size']}, "
          f"{any_row['n_params'] / 1e6:.2f}M params, micro-batch {MICRO}x{SEQ}, 2 gloo ranks, {args.dtype}, AdamW, "
          f"clipping 1.0; {args.repeats} interleaved rounds x {args.steps} steps (median of steps 3..)\n")
    peers = {"ddp": "ddp", "fsdp2": "fsdp2", "deepspeed_z2": "deepspeed_z2", "deepspeed_z3": "deepspeed_z3"}
    ds_of = {"hf_zero_z1": "deepspeed_z1", "hf_zero_z2": "deepspeed_z2", "hf_zero_z3": "deepspeed_z3"}
    time_of = lambda r: r["median"]["total"]  # noqa: E731
    mem_of = lambda r: r["peak_mb"]  # noqa: E731
    head = (f"{'runner':13s} {'step s':>7s} {'spread':>6s} {'peak MB':>8s} {'spread':>6s} {'time/DDP':>17s} "
            f"{'time/FSDP2':>17s} {'time/DS':>17s} {'mem/DDP':>17s} {'mem/FSDP2':>17s} {'mem/DS':>17s} "
            f"{'B/param':>7s} {'formula':>7s} {'loss':>13s}")
    print(head)
    print("-" * len(head))
    for runner in [r for r in RUNNERS + ["deepspeed_z1"] if r in rows]:
        launches = rows[runner]
        times = [time_of(r) for r in launches]
        mems = [mem_of(r) for r in launches]
        t, mb = statistics.median(times), statistics.median(mems)
        ds = ds_of.get(runner)
        sb = launches[0]["state_bytes"]
        per_param = f"{sb / launches[0]['n_params']:.2f}" if sb else "-"
        stage = int(runner[-1]) if runner.startswith("hf_zero") else None
        formula = f"{formulas[stage]:.2f}" if stage else "-"
        loss = f"{launches[0]['loss'][0]:.3f}->{launches[0]['loss'][1]:.3f}"
        print(f"{runner:13s} {t:7.3f} {(max(times) - min(times)) / t:6.1%} {mb:8.0f} "
              f"{(max(mems) - min(mems)) / mb:6.1%} "
              f"{_fmt_ratio(_paired(rows, runner, 'ddp', time_of)):>17s} "
              f"{_fmt_ratio(_paired(rows, runner, 'fsdp2', time_of)):>17s} "
              f"{_fmt_ratio(_paired(rows, runner, ds, time_of) if ds else None):>17s} "
              f"{_fmt_ratio(_paired(rows, runner, 'ddp', mem_of)):>17s} "
              f"{_fmt_ratio(_paired(rows, runner, 'fsdp2', mem_of)):>17s} "
              f"{_fmt_ratio(_paired(rows, runner, ds, mem_of) if ds else None):>17s} "
              f"{per_param:>7s} {formula:>7s} {loss:>13s}")
    del peers
    print("\nstep s: median over rounds of each launch's median step (its slower rank); spread: (max-min)/median "
          "over rounds; ratios: median (min-max) over rounds of the ratio within a round")

    print("\nTime per step, seconds (median over rounds of the per-launch medians; CPU s: the process's CPU time in "
          "the step, all its threads -- compute, gloo, the kernel's page faults -- which the load of a shared "
          "machine inflates far less than the wall time)")
    head = f"{'runner':13s} " + " ".join(f"{k:>9s}" for k in ("forward", "backward", "step", "comm wait", "CPU s"))
    print(head)
    for runner in [r for r in RUNNERS + ["deepspeed_z1"] if r in rows]:
        launches = rows[runner]
        cells = [statistics.median(r["median"][k] for r in launches) for k in PHASES]
        comm = [r["median"].get("communication") for r in launches]
        cells.append(statistics.median(comm) if None not in comm else None)
        cpu = [r["median"].get("cpu") for r in launches]
        cells.append(statistics.median(cpu) if None not in cpu else None)
        print(f"{runner:13s} " + " ".join("        -" if c is None else f"{c:9.3f}" for c in cells))

    print("\nPage faults per step, thousands (median over rounds; minor faults: first touches of fresh memory)")
    print(f"{'runner':13s} " + " ".join(f"{k:>9s}" for k in PHASES))
    for runner in [r for r in RUNNERS + ["deepspeed_z1"] if r in rows]:
        cells = [statistics.median(r["median"].get(f"faults_{p}", 0) for r in rows[runner]) / 1e3 for p in PHASES]
        print(f"{runner:13s} " + " ".join(f"{c:9.1f}" for c in cells))

    print("\nMemory per rank, MB (median over rounds; the larger rank): RSS after imports, after building the model, "
          "after the wrapper/engine is built, and the peak of each phase of the last step")
    head = f"{'runner':13s} " + " ".join(f"{k:>9s}" for k in ("imports", "model", "wrapped", "forward",
                                                                  "backward", "step", "peak"))
    print(head)
    for runner in [r for r in RUNNERS + ["deepspeed_z1"] if r in rows]:
        launches = rows[runner]
        cells = [statistics.median(r[k] for r in launches) for k in ("baseline_mb", "built_mb", "init_mb")]
        cells += [statistics.median(r["phase_mb"][p] for r in launches) for p in PHASES]
        cells.append(statistics.median(r["peak_mb"] for r in launches))
        print(f"{runner:13s} " + " ".join(f"{c:9.0f}" for c in cells))
    for runner in [r for r in RUNNERS + ["deepspeed_z1"] if r in rows]:
        ops = rows[runner][-1]["ops"]
        if ops:
            print(f"\n{runner}: top operators of one profiled step (self CPU s, slower rank, last round)")
            for name, count, sec in ops[:12]:
                print(f"  {name[:60]:60s} {count:6d} {sec:8.3f}")
    for runner, note in notes.items():
        print(f"\n{runner}: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--size", choices=sorted(SIZES), default="32m")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every runner")
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--ds-python", default="/work/venvs/ds/bin/python",
                        help="python of a virtual environment with the real DeepSpeed installed")
    parser.add_argument("--results", help="print the report of an earlier run's output directory")
    parser.add_argument("--hf-extra", default="{}",
                        help="JSON merged into the hf_zero runners' config, "
                             "e.g. '{\"comms_divergence_check\": false}'")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step op by op (torch.profiler; slows that step, not the others)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.size, args.dtype, args.steps, args.out, args.profile)
        return
    notes = {}
    if args.results:
        out_dir = args.results
    else:
        out_dir = tempfile.mkdtemp(prefix="bench_zero_")
        print(f"results in {out_dir}", flush=True)
        for round_ in range(args.repeats):
            for runner in args.runners.split(","):
                print(f"round {round_}: {runner} ...", flush=True)
                sub = Path(out_dir, f"round{round_}")
                sub.mkdir(exist_ok=True)
                note = _launch(runner, args, str(sub))
                if note:
                    notes[runner] = note
                    print(f"  {note.splitlines()[0]}", flush=True)
    report(_load(out_dir), args, notes)


if __name__ == "__main__":
    main()
