"""Pipeline schedule quality: measured bubble fraction beside theory, and hf_zero's step time beside raw torch.

    python benchmarks/bench_pipeline.py --stages 4 --micro-batches 4 8 16 --tf-ms 20

Every stage's compute is a fixed sleep (forward t_f, backward 2 t_f, inside an autograd Function), so the figures do
not depend on how loaded the machine's cores are. For p stages and m micro-batches each rank computes for
m (t_f + t_b); the measured bubble is 1 - m (t_f + t_b) / step time, next to the theoretical (p-1)/(m+p-1)
((p-1)/(v m+p-1) with v virtual stages per rank). The same stages run once through hf_zero's PipelineEngine
(train_batch: schedule, gradient reduction, clip norm across stages, optimizer step) and once through raw
torch.distributed.pipelining (schedule.step + torch.optim.SGD), in one launch. DeepSpeed's PipelineEngine is not
measured here (DeepSpeed is not installed in this environment).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_zero.testing import run_distributed  # noqa: E402

WIDTH, MICRO = 8, 2


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds_fwd, seconds_bwd):
        time.sleep(seconds_fwd)
        ctx.seconds_bwd = seconds_bwd
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds_bwd)
        return grad, None, None


class SleepLayer(nn.Module):
    """A tiny linear layer whose forward takes t_f and backward 2 t_f of wall time."""

    def __init__(self, tf: float):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.tf = tf

    def forward(self, x):
        return _Sleep.apply(self.linear(x), self.tf, 2 * self.tf)


def _median_step(fn, repeats: int) -> float:
    fn()  # shape inference, first-step allocation
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bench(stages: int, micro_batches: list[int], tf: float, repeats: int, schedules: list[str]):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    import hf_zero
    from hf_zero.pipe import LayerSpec, PipelineModule
    from hf_zero.pipeline.schedules import build_schedule

    rows = []
    for schedule in schedules:
        virtual = 2 if schedule == "interleaved_1f1b" else 1
        for m in micro_batches:
            layer_tf = tf / virtual  # the same compute per rank and micro-batch whatever the cut
            layers = [LayerSpec(SleepLayer, layer_tf) for _ in range(stages * virtual)]
            net = PipelineModule(layers, num_stages=stages, loss_fn=nn.functional.mse_loss, seed_layers=True,
                                 partition_method="uniform", virtual_stages=virtual)
            cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
                   "gradient_clipping": 1.0, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
                   "pipeline": {"schedule": schedule, "virtual_stages": virtual}, "steps_per_print": 10 ** 9}
            engine, *_ = hf_zero.initialize(model=net, config=cfg)
            x, y = torch.randn(m, MICRO, WIDTH), torch.randn(m, MICRO, WIDTH)
            ours = _median_step(lambda: engine.train_batch(iter([(x[j], y[j]) for j in range(m)])), repeats)
            engine.destroy()

            # raw torch: the same layers, torch's stages and schedule, a plain SGD step
            raw_net = PipelineModule(layers, num_stages=stages, loss_fn=nn.functional.mse_loss, seed_layers=True,
                                     partition_method="uniform", virtual_stages=virtual)
            stage_objs = [PipelineStage(mod, idx, stages * virtual, torch.device("cpu"),
                                        group=raw_net.grid.get_pipe_parallel_group())
                          for idx, mod in raw_net.chunk_modules()]
            sched = build_schedule(schedule, stage_objs, m, loss_fn=lambda out, tgt: nn.functional.mse_loss(out, tgt))
            opt = torch.optim.SGD(raw_net.parameters(), lr=1e-3)
            first, last = raw_net.stage_id == 0, raw_net.stage_id == stages - 1
            xs, ys = x.reshape(-1, WIDTH), y.reshape(-1, WIDTH)

            def raw_step():
                args = (xs,) if first else ()
                sched.step(*args, target=ys if last else None, losses=[] if last else None,
                           return_outputs=False)
                opt.step()
                opt.zero_grad()

            raw = _median_step(raw_step, repeats)
            busy = m * 3 * tf  # t_f + t_b = 3 t_f per micro-batch and rank
            theory = (stages - 1) / (virtual * m + stages - 1)
            rows.append({"schedule": schedule, "p": stages, "m": m, "v": virtual, "theory": round(theory, 3),
                         "bubble_hf_zero": round(1 - busy / ours, 3), "bubble_torch": round(1 - busy / raw, 3),
                         "step_s_hf_zero": round(ours, 4), "step_s_torch": round(raw, 4),
                         "ratio": round(ours / raw, 3)})
            dist.barrier()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b"])
    parser.add_argument("--tf-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = run_distributed(_bench, world_size=args.stages,
                              args=(args.stages, args.micro_batches, args.tf_ms / 1000, args.repeats,
                                    args.schedules), timeout_s=3000)
    rows = results[0]
    print("| schedule | p | m | v | theory | bubble hf_zero | bubble torch | step s hf_zero | step s torch | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['theory']:.3f} | {r['bubble_hf_zero']:.3f} | "
              f"{r['bubble_torch']:.3f} | {r['step_s_hf_zero']:.3f} | {r['step_s_torch']:.3f} | {r['ratio']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
