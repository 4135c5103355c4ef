"""Cost of ``comms_divergence_check`` (one 5-integer all-gather before every collective): ZeRO-3 step time with the
check on and off, side by side in one run, 2 gloo ranks on CPU.

    OMP_NUM_THREADS=1 python benchmarks/bench_divergence_check.py [layers] [width] [steps]

Prints the median step time of each setting and the ratio. Small layers make the check's latency stand out;
large ones hide it.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

from hf_zero.testing import run_distributed


def _bench(check: bool, layers: int, width: int, steps: int) -> list[float]:
    import hf_zero

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "comms_divergence_check": check}
    engine, *_ = hf_zero.initialize(model=model, config=cfg)
    x = torch.randn(8, width)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[2:]


def main() -> None:
    layers, width, steps = (int(a) for a in (sys.argv[1:] + ["16", "512", "12"][len(sys.argv) - 1:]))
    result = {}
    for check in (True, False, True, False):
        per_rank = run_distributed(_bench, 2, args=(check, layers, width, steps), timeout_s=600)
        result.setdefault(check, []).extend(per_rank[0])
    on, off = statistics.median(result[True]), statistics.median(result[False])
    print(f"ZeRO-3, {layers} x Linear({width},{width}), 2 ranks: step median check on {on * 1e3:.1f} ms, "
          f"off {off * 1e3:.1f} ms, ratio {on / off:.2f}")


if __name__ == "__main__":
    main()
