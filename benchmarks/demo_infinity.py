"""ZeRO-Infinity on a small machine: fine-tune a Llama-architecture model whose parameters and optimizer states do
not fit in RAM, with ZeRO-3, ``offload_param: nvme`` and ``offload_optimizer: nvme``.

    torchrun --nproc_per_node 2 benchmarks/demo_infinity.py --nvme-path /var/tmp/hf_zero_nvme          # ~3.4B
    torchrun --nproc_per_node 2 benchmarks/demo_infinity.py --nvme-path /tmp/x --layers 2 --hidden 256  # smoke

The model (a Llama-3.2-3B-like shape, 32000-token vocabulary, fp32 weights) is built under ``zero.Init`` with the
same config, so every partition goes to the NVMe files as soon as its layer is built and the model is never whole
in memory. It trains for ``--steps`` steps on byte tokens of the shipped corpus (``examples/data``).

Where the bytes are, per parameter (fp32 training, N ranks):
    NVMe    4 (the fp32 partitions) + 12 (fp32 master + Adam moments)   = 16 B/param, split over the ranks
    RAM     4 / N (this rank's fp32 gradient shard) + the layers gathered at a time + tile buffers

Reported by rank 0 at the end, one JSON line: parameters, state bytes vs MemTotal, per-rank peak RSS (VmHWM),
bytes in the swap files, seconds per step (each step, and the median after the first), losses.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
_M_MMAP_THRESHOLD = -3  # mallopt parameter number, from glibc's malloc.h


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemTotal")


def _config(args) -> dict:
    nvme = {"device": "nvme", "nvme_path": args.nvme_path}
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3, "offload_param": dict(nvme), "offload_optimizer": dict(nvme),
            # tiles of the optimizer step: 2 sets x 3 fp32 streams x 4 B x sub_group_size resident
            "sub_group_size": args.sub_group_size,
            "stage3_prefetch_bucket_size": args.prefetch, "stage3_max_live_parameters": 3 * args.prefetch,
            "stage3_param_persistence_threshold": 10 * args.hidden, "reduce_bucket_size": args.prefetch},
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2},
    }


def _llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 128),
                       tie_word_embeddings=False)


def _batches(args, rank: int, world: int):
    text = (ROOT / "examples" / "data" / "synthetic_train.txt").read_bytes()
    ids = torch.tensor(list(text), dtype=torch.long)
    per_step = world * args.micro_batch * args.seq
    for s in range(args.steps):
        start = (s * per_step) % (ids.numel() - per_step)
        chunk = ids[start:start + per_step].view(world, args.micro_batch, args.seq)
        yield chunk[rank]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", required=True, help="directory for the swap files (a fast local drive)")
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sub-group-size", type=int, default=50_000_000)
    p.add_argument("--prefetch", type=int, default=50_000_000, help="stage3_prefetch_bucket_size (elements)")
    args = p.parse_args()

    # glibc serves buffers below its dynamic mmap threshold (up to 32 MiB) from the heap and keeps them after
    # free; the gathers allocate and free layer-sized buffers all the time, so map every buffer of 1 MiB or more
    # and give it back when freed: the RSS reported below is then what the engine really holds.
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 1 << 20)

    import hf_zero
    from hf_zero.comm import init_distributed
    from hf_zero.zero import Init

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(args)
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)

    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    with Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(_llama_config(args))
    n_params = sum(p.ds_numel for p in model.parameters())
    build_s = time.perf_counter() - t0
    rss_built = _status_bytes("VmRSS")

    t0 = time.perf_counter()
    engine, *_ = hf_zero.initialize(model=model, config=cfg)
    init_s = time.perf_counter() - t0
    disk = engine.stage3.swapper.nbytes + engine.optimizer.offload.swap.nbytes
    engine.phase_seconds_total()  # starts the per-phase totals (forward, backward, step, offload_io, ...)

    step_s, losses = [], []
    for ids in _batches(args, rank, world):
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        step_s.append(time.perf_counter() - t0)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(round(t.item() / world, 4))
        if rank == 0:
            print(f"[demo_infinity] step {len(step_s)}: loss {losses[-1]:.4f}, {step_s[-1]:.1f} s", flush=True)

    mine = torch.tensor([_status_bytes("VmHWM"), disk, rss_built], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    phases = engine.phase_seconds_total()
    # NOTE: no engine.destroy(): it hands every rank the whole model as ordinary tensors, which is exactly what does
    # not fit here. The swap files are removed at interpreter exit.
    if rank == 0:
        mem = _mem_total()
        disk_total = sum(int(e[1]) for e in every)
        report = {
            "params": n_params, "world_size": world, "layers": args.layers, "hidden": args.hidden,
            "tokens_per_step": world * args.micro_batch * args.seq,
            "mem_total_gib": round(mem / GiB, 2),
            "states_16B_per_param_gib": round(16 * n_params / GiB, 2),
            "states_vs_ram": round(16 * n_params / mem, 2),
            "optimizer_12B_per_param_gib": round(12 * n_params / GiB, 2),
            "peak_rss_gib_per_rank": [round(float(e[0]) / GiB, 2) for e in every],
            "peak_rss_gib_sum": round(sum(float(e[0]) for e in every) / GiB, 2),
            "rss_after_build_gib_per_rank": [round(float(e[2]) / GiB, 2) for e in every],
            "swap_bytes_total": disk_total, "swap_gib_total": round(disk_total / GiB, 2),
            "build_s": round(build_s, 1), "initialize_s": round(init_s, 1),
            "step_s": [round(s, 1) for s in step_s],
            "median_step_s_after_first": round(statistics.median(step_s[1:]), 1) if len(step_s) > 1 else None,
            "losses": losses, "phase_seconds_rank0": {k: round(v, 1) for k, v in phases.items()},
            "disk_free_gib_at_end": round(shutil.disk_usage(args.nvme_path).free / GiB, 1),
        }
        print("[demo_infinity] " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
