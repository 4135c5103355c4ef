"""Where one training step's time goes on the GPU, per runner of benchmarks/bench_gpu.py: the evidence for the GPU
speed work (which costs are the GPU's, which the host's, and what makes the host wait).

    python benchmarks/profile_gpu_step.py OUT_DIR [--only torch,z0,z3,z2_offload]

For each runner, one extra step after warm-up (the 10th of 12) is measured three ways, each written to
``OUT_DIR/<runner>.txt``:

1. host issue time (from the step's start until the Python call returns, nothing synchronised) against the full
   step time (until the GPU is done): a step whose issue time is close to its full time is bound by the host;
2. every host-device synchronisation in the step, by call site (``torch.cuda.set_sync_debug_mode("warn")``);
3. ``torch.profiler``: the top operators by self CPU time and by CUDA time.

A summary line per runner goes to stdout.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import _gpu_llama as gl  # noqa: E402

RUNNERS = {"torch": (None, False), "fsdp2": ("fsdp2", False), "z0": (0, False), "z1": (1, False), "z2": (2, False), "z3": (3, False),
           "z2_offload": (2, True)}


def _sync_sites(step) -> collections.Counter:
    """Call sites (file:line of the Python frame) of every synchronising CUDA call in ``step()``."""
    sites: collections.Counter = collections.Counter()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.set_sync_debug_mode(0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
    return sites


def probe_into(out_dir: str, lines: list[str]):
    def probe(name: str, step) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        issued = time.perf_counter() - t0
        torch.cuda.synchronize()
        full = time.perf_counter() - t0
        sites = _sync_sites(step)
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        avg = prof.key_averages()
        with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
            f.write(f"{name}: host issue {issued * 1e3:.1f} ms, full step {full * 1e3:.1f} ms, "
                    f"{sum(sites.values())} synchronisations\n\nsynchronising call sites:\n")
            for site, n in sites.most_common():
                f.write(f"  {n:4d}  {site}\n")
            f.write("\nby self CPU time:\n")
            f.write(avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
            f.write("\nby CUDA time:\n")
            f.write(avg.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
        line = (f"{name:<22} host issue {issued * 1e3:7.1f} ms  full {full * 1e3:7.1f} ms  syncs "
                f"{sum(sites.values()):3d}  top: {', '.join(f'{s} x{n}' for s, n in sites.most_common(3))}")
        print(line, flush=True)
        lines.append(line)

    return probe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--only", default=",".join(RUNNERS))
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    lines: list[str] = []
    probe = probe_into(args.out_dir, lines)
    for name in args.only.split(","):
        stage, offload = RUNNERS[name]
        try:
            if stage is None:
                gl.torch_run(probe=probe)
            elif stage == "fsdp2":
                gl.fsdp2_run(probe=probe)
            else:
                gl.hf_zero_run(stage, offload, probe=probe)
        except Exception as exc:  # noqa: BLE001 -- one failing runner is a line, not the end of the profile
            print(f"{name}: FAILED {exc!r}"[:500], flush=True)
    with open(os.path.join(args.out_dir, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
