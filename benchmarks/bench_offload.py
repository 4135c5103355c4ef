"""Offload benchmarks, side by side in one launch.

1. NVMe swap throughput against the raw sequential bandwidth of the same disk, measured in the same run:
   * raw: one thread writing / reading one file sequentially in 8 MiB requests (``os.pwrite`` / ``os.preadv``);
   * swap: hf_zero's :class:`~hf_zero.offload.SwapDir` moving the same number of bytes the way the optimizer
     does: tiles of ``sub_group_size`` fp32 elements, three streams per tile (master, exp_avg, exp_avg_sq),
     asynchronous through the ``aio`` op with the ``aio`` config's block size, queue depth and threads.
   Both are timed to stable storage (``fsync`` after writing) and read cold (``posix_fadvise(DONTNEED)`` drops the
   files from the page cache first), so both measure the disk, not memory. Target: swap >= 80% of raw.

2. ZeRO-2 with ``offload_optimizer: {device: cpu}``: hf_zero against DeepSpeed (``/opt/dsvenv``, its compiled
   CPUAdam) on the same model and config, one process each, run one after the other in this launch. Reported:
   median ``engine.step()`` time (the offloaded optimizer step) and median whole iteration. Target: <= 1.0x.

    python benchmarks/bench_offload.py                      # both parts, swap files under ./.bench_offload
    python benchmarks/bench_offload.py --nvme-dir /mnt/nvme --swap-mib 2048 --hidden 2048 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20
DS_PYTHON = "/opt/dsvenv/bin/python"


# ---- part 1: disk ---------------------------------------------------------------------------------------------------
def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_bandwidth(directory: Path, nbytes: int, request: int = 8 * MiB) -> tuple[float, float]:
    """Sequential single-stream write (to stable storage) and cold read of one file; bytes per second."""
    import torch

    path = str(directory / "raw.bin")
    buf = torch.randint(0, 255, (request,), dtype=torch.uint8).numpy()
    view = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    for off in range(0, nbytes, request):
        os.pwrite(fd, view[:min(request, nbytes - off)], off)
    os.fsync(fd)
    write_s = time.perf_counter() - t0
    os.close(fd)
    _drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    t0 = time.perf_counter()
    for off in range(0, nbytes, request):
        os.preadv(fd, [view[:min(request, nbytes - off)]], off)
    read_s = time.perf_counter() - t0
    os.close(fd)
    os.remove(path)
    return nbytes / write_s, nbytes / read_s


def swap_bandwidth(directory: Path, nbytes: int, tile_numel: int, aio) -> tuple[float, float]:
    """The optimizer's swap pattern (3 fp32 streams, tile by tile, async) over ``nbytes`` in total."""
    import torch

    from hf_zero.offload import SwapDir

    names = ("master", "exp_avg", "exp_avg_sq")
    stream_numel = nbytes // 4 // len(names)
    swap = SwapDir(directory, kind="bench", rank=0, sizes_nbytes={n: stream_numel * 4 for n in names}, aio=aio)
    bufs = [{n: torch.randn(tile_numel) for n in names} for _ in range(2)]
    tiles = list(range(0, stream_numel, tile_numel))
    try:
        t0 = time.perf_counter()
        pending = [[], []]
        for i, lo in enumerate(tiles):
            for f in pending[i % 2]:
                f.result()
            numel = min(tile_numel, stream_numel - lo)
            pending[i % 2] = [swap.write_async(n, bufs[i % 2][n][:numel], lo) for n in names]
        for f in pending[0] + pending[1]:
            f.result()
        for n in names:
            _drop_cache(swap.file(n))  # fsync: the writes reach the disk (timed), then leave the page cache
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reads = [swap.read_async(n, bufs[0][n][:min(tile_numel, stream_numel)], 0) for n in names]
        for i, lo in enumerate(tiles):
            for f in reads:
                f.result()
            if i + 1 < len(tiles):
                nxt, numel = tiles[i + 1], min(tile_numel, stream_numel - tiles[i + 1])
                reads = [swap.read_async(n, bufs[(i + 1) % 2][n][:numel], nxt) for n in names]
        read_s = time.perf_counter() - t0
    finally:
        swap.close()
    moved = stream_numel * 4 * len(names)
    return moved / write_s, moved / read_s


def bench_disk(args) -> dict:
    from hf_zero.offload import AioParams
    from hf_zero.ops.aio import _native

    directory = Path(args.nvme_dir)
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = args.swap_mib * MiB
    aio = AioParams(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.thread_count)
    rows = []
    for _ in range(args.repeats):  # alternate, so drift on a shared disk hits both alike
        raw_w, raw_r = raw_bandwidth(directory, nbytes)
        swap_w, swap_r = swap_bandwidth(directory, nbytes, args.sub_group_size, aio)
        rows.append((raw_w, raw_r, swap_w, swap_r))
    med = [statistics.median(col) for col in zip(*rows)]
    return {"bytes": nbytes, "native_aio": _native(), "raw_write_MBps": med[0] / 1e6, "raw_read_MBps": med[1] / 1e6,
            "swap_write_MBps": med[2] / 1e6, "swap_read_MBps": med[3] / 1e6,
            "write_ratio": med[2] / med[0], "read_ratio": med[3] / med[1]}


# ---- part 2: CPU offload step, hf_zero vs DeepSpeed ------------------------------------------------------------------
def _config(args) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                 "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
           "steps_per_print": 10**9}
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def worker(args) -> None:
    """One engine, one process; prints a JSON line with per-iteration and per-step times."""
    import torch
    import torch.distributed as dist
    from torch import nn

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    for key in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(key, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.GELU()]
    model = nn.Sequential(*layers)
    nparams = sum(p.numel() for p in model.parameters())
    if args.worker == "hf_zero":
        import hf_zero

        engine, *_ = hf_zero.initialize(model=model, config=_config(args))
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(args))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = torch.randn(args.batch, args.hidden, dtype=dtype)
    step_s, iter_s = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        if i >= args.warmup:
            step_s.append(t2 - t1)
            iter_s.append(t2 - t0)
    print("RESULT " + json.dumps({"params": nparams, "step_s": statistics.median(step_s),
                                  "iter_s": statistics.median(iter_s), "threads": torch.get_num_threads()}))


def _launch(args, which: str, python: str) -> dict:
    cmd = [python, __file__, "--worker", which, "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--dtype", args.dtype, "--port", str(args.port + (1 if which == "deepspeed" else 0))]
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_ZERO_DISABLE_DEEPSPEED_SHIM="1")
    if which == "hf_zero":
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{which} worker failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def bench_step(args) -> dict:
    rows = {"hf_zero": [], "deepspeed": []}
    for _ in range(args.repeats):  # alternate the two, so load on the shared machine hits both alike
        rows["hf_zero"].append(_launch(args, "hf_zero", sys.executable))
        rows["deepspeed"].append(_launch(args, "deepspeed", DS_PYTHON))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("step_s", "iter_s")} for k, v in rows.items()}
    return {"params": rows["hf_zero"][0]["params"], "dtype": args.dtype, **{f"{k}_{m}": v[m] for k, v in med.items()
                                                                           for m in v},
            "step_ratio": med["hf_zero"]["step_s"] / med["deepspeed"]["step_s"],
            "iter_ratio": med["hf_zero"]["iter_s"] / med["deepspeed"]["iter_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "disk", "step"), default="all")
    p.add_argument("--nvme-dir", default=".bench_offload")
    p.add_argument("--swap-mib", type=int, default=512)
    p.add_argument("--sub-group-size", type=int, default=1 << 22, help="elements per tile (4M = 16 MiB per stream)")
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--thread-count", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--worker", choices=("hf_zero", "deepspeed"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.part in ("all", "disk"):
        try:
            print("disk:", json.dumps(bench_disk(args), indent=1), flush=True)
        finally:
            shutil.rmtree(args.nvme_dir, ignore_errors=True)
    if args.part in ("all", "step"):
        print("cpu offload step:", json.dumps(bench_step(args), indent=1), flush=True)


if __name__ == "__main__":
    main()
