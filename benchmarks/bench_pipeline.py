"""Pipeline schedule quality: measured bubble beside theory; hf_zero's step time beside raw torch pipelining and
DeepSpeed's PipelineEngine on the same model and schedule, in one run.

    python benchmarks/bench_pipeline.py --stages 4 --micro-batches 4 8 16 --tf-ms 20 --repeats 5

Every stage's compute is a fixed sleep (forward t_f, backward 2 t_f, inside an autograd Function:
benchmarks/_pipe_sleep.py), so the figures do not depend on how loaded the machine's cores are. The bubble of a rank
is 1 - (time it spent computing) / step time, where the compute time is what the sleeps actually took (a sleep
overshoots on a loaded machine; that counts as compute, not as pipeline overhead); the table gives the mean over
ranks, beside the theoretical (p-1)/(m+p-1) ((p-1)/(v m+p-1) with v virtual stages per rank). A step's time is from
the first rank's start to the last rank's end (all ranks leave a barrier first).

Three frameworks run the same layers (seeded alike) and data:
  * hf_zero: PipelineEngine.train_batch (torch's schedule, gradient reduction, the clip norm across stages,
    the optimizer step, the loss sent to every stage);
  * raw torch: torch.distributed.pipelining's PipelineStage + schedule over nn.Sequential chunks, then SGD;
  * DeepSpeed (1F1B rows only: its PipelineEngine runs its own 1F1B TrainSchedule): train_batch in DeepSpeed's
    virtual environment (--ds-python, DS_ACCELERATOR=cpu, gloo), one process per stage, started by this script and
    driven step by step through a TCP store.
Each repeat runs one step of each framework, the order rotating from repeat to repeat, so a change in the machine's
load during the run reaches all three alike; the table gives medians over the repeats (after one untimed step each).

"overhead ms/slot" is what a step takes beyond a perfect schedule with the same compute (the mean compute per rank
over 1 - theory), divided by the v m + p - 1 micro-batch slots of the critical path: the cost of each hand-over
(gloo messages, waking the receiving process, the schedule's Python). It is what the machine's load changes (a
woken process waits for a core); a larger --tf-ms shrinks its share of the step, and so the bubble's excess.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _pipe_sleep import BUSY, MICRO, WIDTH, SleepLayer, batches  # noqa: E402
from hf_zero.comm.process_group import free_port  # noqa: E402
from hf_zero.testing import run_distributed  # noqa: E402

DEFAULT_DS_PYTHON = "/work/venvs/ds/bin/python"


def _timed(fn):
    """One step of ``fn`` on every rank: (step time across ranks, each rank's compute seconds)."""
    import torch.distributed as dist

    dist.barrier()
    busy0 = BUSY[0]
    start = time.perf_counter()  # CLOCK_MONOTONIC: comparable between processes
    fn()
    end = time.perf_counter()
    mine = torch.tensor([start, end, BUSY[0] - busy0], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return max(t[1].item() for t in every) - min(t[0].item() for t in every), [t[2].item() for t in every]


def _ds_step(store, cfg_id: int, repeat: int, stages: int):
    """Rank 0: tell the DeepSpeed ranks to take one step, wait for their times."""
    store.set(f"go/{cfg_id}/{repeat}", "go")
    keys = [f"t/{cfg_id}/{repeat}/{r}" for r in range(stages)]
    store.wait(keys)
    got = [[float(v) for v in store.get(k).decode().split()] for k in keys]
    return max(g[1] for g in got) - min(g[0] for g in got), [g[2] for g in got]


def _raw_torch(stages: int, virtual: int, layer_tf: float, m: int, schedule: str, x, y):
    """torch.distributed.pipelining alone: one nn.Sequential per chunk, torch's schedule, plain SGD."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from hf_zero.pipeline.schedules import SCHEDULES, MULTI_STAGE

    rank, n_chunks = dist.get_rank(), stages * virtual
    chunks = []
    for c in range(rank, n_chunks, stages):  # chunk c runs on rank c % stages (interleaved placement)
        torch.manual_seed(1234 + c)
        chunks.append((c, nn.Sequential(SleepLayer(layer_tf))))
    group = dist.new_group(list(range(stages)))
    objs = [PipelineStage(mod, c, n_chunks, torch.device("cpu"), group=group) for c, mod in chunks]
    cls = SCHEDULES[schedule]
    loss_fn = nn.functional.mse_loss
    sched = cls(objs, m, loss_fn=loss_fn) if schedule in MULTI_STAGE else cls(objs[0], m, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for _, mod in chunks for p in mod.parameters()], lr=1e-3)
    xs, ys = x.reshape(-1, WIDTH), y.reshape(-1, WIDTH)
    first, last = rank == 0, rank == stages - 1

    def step():
        sched.step(*((xs,) if first else ()), target=ys if last else None, losses=[] if last else None,
                   return_outputs=False)
        opt.step()
        opt.zero_grad()

    return step


def _bench(stages: int, micro_batches: list[int], tf: float, repeats: int, schedules: list[str], store_port):
    import torch.distributed as dist

    import hf_zero
    from hf_zero.pipe import LayerSpec, PipelineModule

    rank = dist.get_rank()
    store = None
    if store_port is not None and rank == 0:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=1800))
    rows, ds_cfg = [], 0
    for schedule in schedules:
        virtual = 2 if schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble") else 1
        for m in micro_batches:
            layer_tf = tf / virtual  # the same compute per rank and micro-batch whatever the cut
            x, y = batches(m)
            net = PipelineModule([LayerSpec(SleepLayer, layer_tf) for _ in range(stages * virtual)],
                                 num_stages=stages, loss_fn=nn.functional.mse_loss, seed_layers=True,
                                 partition_method="uniform", virtual_stages=virtual)
            cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
                   "gradient_clipping": 1.0, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
                   "pipeline": {"schedule": schedule, "virtual_stages": virtual}, "steps_per_print": 10 ** 9}
            engine, *_ = hf_zero.initialize(model=net, config=cfg)
            data = [(x[j], y[j]) for j in range(m)]
            runners = {"hf_zero": lambda: engine.train_batch(iter(data)),
                       "torch": _raw_torch(stages, virtual, layer_tf, m, schedule, x, y)}
            with_ds = store_port is not None and schedule == "1f1b"
            if with_ds and rank == 0:
                store.set(f"cfg/{ds_cfg}", f"{m} {layer_tf}")
                store.wait([f"built/{ds_cfg}/{r}" for r in range(stages)])
            for fn in runners.values():
                fn()  # shape inference, first-step allocation
            names = list(runners) + (["deepspeed"] if with_ds else [])
            times = {n: [] for n in names}
            busy = {n: [] for n in names}
            for r in range(repeats):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    if name == "deepspeed":
                        got = _ds_step(store, ds_cfg, r, stages) if rank == 0 else None
                        box = [got]
                        dist.broadcast_object_list(box, src=0)
                        step_s, per_rank = box[0]
                    else:
                        step_s, per_rank = _timed(runners[name])
                    times[name].append(step_s)
                    busy[name].append(per_rank)
            if with_ds:
                if rank == 0:
                    store.set(f"go/{ds_cfg}/{repeats}", "stop")
                ds_cfg += 1
            engine.destroy()
            theory = (stages - 1) / (virtual * m + stages - 1)
            row = {"schedule": schedule, "p": stages, "m": m, "v": virtual, "theory": round(theory, 4)}
            slots = virtual * m + stages - 1
            for name in names:
                med = statistics.median(times[name])
                bubbles = [statistics.mean(1 - b / t for b in per) for t, per in zip(times[name], busy[name])]
                row[f"step_s_{name}"] = round(med, 4)
                row[f"bubble_{name}"] = round(statistics.median(bubbles), 4)
                # the step a perfect schedule would take with the compute the sleeps really took, and what the
                # measured step adds to it per micro-batch slot of the critical path (messages, wake-ups, Python)
                ideal = [statistics.mean(per) / (1 - theory) for per in busy[name]]
                row[f"overhead_ms_per_slot_{name}"] = round(
                    1000 * statistics.median((t - i) / slots for t, i in zip(times[name], ideal)), 2)
                row[f"steps_{name}"] = [round(t, 4) for t in times[name]]
            row["compute_per_rank_s"] = round(statistics.median(sum(b) / len(b) for b in busy["torch"]), 4)
            row["compute_nominal_s"] = round(m * 3 * tf, 4)
            rows.append(row)
            dist.barrier()
    if store is not None:
        store.set(f"cfg/{ds_cfg}", "end")
    return rows


def _start_deepspeed(ds_python: str, stages: int, store_port: int, log_dir: Path) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # DeepSpeed's own, never hf_zero's shim
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(stages))
    procs = []
    for rank in range(stages):
        log = open(log_dir / f"deepspeed_rank{rank}.log", "w")
        procs.append(subprocess.Popen([ds_python, str(HERE / "bench_pipeline_ds_worker.py"), str(store_port),
                                       str(stages)], env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def _fmt(row, key, spec=".3f"):
    return format(row[key], spec) if key in row else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b"])
    parser.add_argument("--tf-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ds-python", default=DEFAULT_DS_PYTHON,
                        help="Python of a virtual environment with DeepSpeed ('none': skip DeepSpeed)")
    parser.add_argument("--log-dir", default="/tmp/bench_pipeline_logs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    use_ds = args.ds_python != "none" and "1f1b" in args.schedules
    if use_ds and not Path(args.ds_python).exists():
        parser.error(f"--ds-python {args.ds_python} does not exist; give DeepSpeed's venv python or 'none'")
    store = store_port = None
    procs: list[subprocess.Popen] = []
    if use_ds:
        import torch.distributed as dist

        store_port = free_port()
        store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=1800))
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        procs = _start_deepspeed(args.ds_python, args.stages, store_port, log_dir)
    try:
        results = run_distributed(_bench, world_size=args.stages,
                                  args=(args.stages, args.micro_batches, args.tf_ms / 1000, args.repeats,
                                        args.schedules, store_port), timeout_s=3000)
    finally:
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
        del store
    rows = results[0]
    print(f"p={args.stages} stages, t_f={args.tf_ms} ms, t_b=2 t_f; medians of {args.repeats} interleaved steps")
    print("| schedule | p | m | v | theory | bubble hf_zero | bubble torch | bubble DeepSpeed | step s hf_zero | "
          "step s torch | step s DeepSpeed | hf_zero / torch | hf_zero / DeepSpeed | overhead ms/slot "
          "hf_zero / torch / DeepSpeed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio_ds = (f"{r['step_s_hf_zero'] / r['step_s_deepspeed']:.3f}" if "step_s_deepspeed" in r else "-")
        print(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['theory']:.3f} | "
              f"{_fmt(r, 'bubble_hf_zero')} | {_fmt(r, 'bubble_torch')} | {_fmt(r, 'bubble_deepspeed')} | "
              f"{_fmt(r, 'step_s_hf_zero')} | {_fmt(r, 'step_s_torch')} | {_fmt(r, 'step_s_deepspeed')} | "
              f"{r['step_s_hf_zero'] / r['step_s_torch']:.3f} | {ratio_ds} | "
              f"{_fmt(r, 'overhead_ms_per_slot_hf_zero', '.1f')} / {_fmt(r, 'overhead_ms_per_slot_torch', '.1f')} / "
              f"{_fmt(r, 'overhead_ms_per_slot_deepspeed', '.1f')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
