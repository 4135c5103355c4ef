"""Where a rank's bytes go, per phase, for hf_zero ZeRO stages 1-3 beside DDP and FSDP2 (2 CPU ranks, gloo).

    python benchmarks/bench_zero_memory.py --size 32m                      # ddp, fsdp2, hf_zero z1/z2/z3
    python benchmarks/bench_zero_memory.py --size 32m --malloc-threshold 131072   # glibc heap retention check

Per runner and rank, after one warm-up step, one measured step:

* RSS (VmRSS) after imports, after building the model, after building the wrapper/engine; peak RSS (VmHWM,
  reset between phases through /proc/self/clear_refs) of forward, backward and optimizer step;
* tensor bytes counted from the objects themselves (hf_zero): full parameters, fp32 master shard, 16-bit shard
  when it is a separate copy, gradient shard (at the end of backward), optimizer states, full ``param.grad``
  still alive at the end of backward, the reduce buckets' bytes (largest window of buckets alive at once, from the
  reducer's bucket table), ZeRO-3's peak of gathered full parameters, and the activations autograd saved in
  forward (distinct storages, through saved-tensor hooks);
* allocator retention: the RSS that ``malloc_trim(0)`` hands back after the step (freed heap glibc kept).

``--malloc-threshold N`` launches the ranks with ``MALLOC_MMAP_THRESHOLD_=N`` (a fixed threshold: glibc no longer
raises it after freeing a large block, so freed tensors of >= N bytes go back to the kernel at once).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_zero import LR, MICRO, SEQ, SIZES, _ds_config, _model, _reset_peak, _status_kb  # noqa: E402

RUNNERS = ["ddp", "fsdp2", "hf_zero_z1", "hf_zero_z2", "hf_zero_z3"]
MB = 2 ** 20


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None and hasattr(t, "to_local"):  # FSDP2's DTensors: this rank's shard
            t = t.to_local()
        if t is not None and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _trim() -> int:
    """RSS bytes glibc hands back on malloc_trim(0) (freed heap memory it had kept)."""
    before = _status_kb("VmRSS")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return (before - _status_kb("VmRSS")) * 1024


def _bucket_window_bytes(engine) -> int:
    """Largest bytes of reduce buckets alive at once: the one being packed plus those in flight (stages 0-2), or
    the filling bucket plus one in flight (stage 3); a result buffer beside each unless reduced in place."""
    if engine.reducer is not None:
        r = engine.reducer
        sizes = []
        for b in r.buckets:
            lo, hi = b.group.layout.span(b.start, b.stop)
            sizes.append((hi - lo) * r.world_size * b.group.grad.element_size())
        window = r.max_in_flight + 1
        return max(sum(sizes[i:i + window]) for i in range(len(sizes))) if sizes else 0
    red = engine.stage3.reducer
    from hf_zero.comm.buckets import capped_bucket_numel

    return 2 * capped_bucket_numel(red.bucket_numel, 4) * 4


def worker(runner: str, size: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import transformers  # noqa: F401

    rank = int(os.environ["RANK"])
    vocab = SIZES[size]["vocab_size"]
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, vocab, (MICRO, SEQ), generator=g) for _ in range(2)]
    rss = {"imports": _status_kb("VmRSS") * 1024}
    tensors: dict[str, int] = {}
    engine = None
    if runner.startswith("hf_zero"):
        import hf_zero

        stage = int(runner[-1])
        cfg = _ds_config(stage, False)
        if stage == 3:
            hf_zero.init_distributed(dist_backend="gloo")
        model = _model(size, cfg if stage == 3 else None)
        rss["model"] = _status_kb("VmRSS") * 1024
        engine, *_ = hf_zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def forward(ids):
            return engine(input_ids=ids, labels=ids).loss

        def backward(loss):
            engine.backward(loss)

        def step():
            engine.step()
    else:
        model = _model(size, None)
        rss["model"] = _status_kb("VmRSS") * 1024
        dist.init_process_group("gloo")
        if runner == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=LR, weight_decay=0.01)

        def forward(ids):
            return wrapped(input_ids=ids, labels=ids).loss

        def backward(loss):
            loss.backward()

        def step():
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    rss["wrapped"] = _status_kb("VmRSS") * 1024

    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    for i, ids in enumerate(batches):
        last = i == len(batches) - 1
        dist.barrier()
        if last:
            _reset_peak()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = forward(ids)
            rss["forward"] = _status_kb("VmHWM") * 1024
            _reset_peak()
        else:
            loss = forward(ids)
        backward(loss)
        if last:
            rss["backward"] = _status_kb("VmHWM") * 1024
            if engine is not None:
                tensors["gradient shard (end of backward)"] = _storage_bytes(g.grad for g in engine.groups)
                tensors["full param.grad (end of backward)"] = _storage_bytes(p.grad for p in model.parameters())
            _reset_peak()
        step()
        if last:
            rss["step"] = _status_kb("VmHWM") * 1024
    rss["after step"] = _status_kb("VmRSS") * 1024
    tensors["activations saved by autograd"] = sum(saved.values())
    if engine is not None:
        masters = [g.master for g in engine.groups]
        tensors["parameters (module, full or persistent)"] = _storage_bytes(p.data for p in model.parameters())
        tensors["master shard (fp32; also the weights' shard at stage 3 fp32)"] = _storage_bytes(masters)
        tensors["param16 shard (when a separate copy)"] = _storage_bytes(
            g.param16 for g in engine.groups if g.param16 is not None and g.param16 is not g.master)
        tensors["optimizer states"] = _storage_bytes(t for st in engine.optimizer.state.values() for t in st.values()
                                                     if torch.is_tensor(t) and t.numel() > 1)
        tensors["gradient shard (after step)"] = _storage_bytes(g.grad for g in engine.groups)
        tensors["reduce buckets (largest window alive)"] = _bucket_window_bytes(engine)
        if engine.stage3 is not None:
            tensors["gathered full parameters (peak)"] = engine.stage3.gatherer.peak_live_bytes
    else:
        tensors["parameters (local)"] = _storage_bytes(p.data for p in model.parameters())
        tensors["optimizer states"] = _storage_bytes(t for st in opt.state.values() for t in st.values()
                                                     if torch.is_tensor(t) and t.numel() > 1)
        if runner == "ddp":
            tensors["DDP gradient buckets"] = sum(b.buffer().numel() * b.buffer().element_size()
                                                  for b in wrapped.reducer._get_zeros_like_grad_buckets()) \
                if hasattr(wrapped.reducer, "_get_zeros_like_grad_buckets") else 0
    rss["trimmed by malloc_trim"] = _trim()
    rss["peak"] = _status_kb("VmHWM") * 1024
    Path(out_dir, f"{runner}.{rank}.json").write_text(json.dumps({"rss": rss, "tensors": tensors}))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--size", choices=sorted(SIZES), default="32m")
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--malloc-threshold", type=int, help="MALLOC_MMAP_THRESHOLD_ for the ranks")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.size, args.out)
        return
    from hf_zero.comm.process_group import free_port

    out_dir = tempfile.mkdtemp(prefix="bench_zero_memory_")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.malloc_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_threshold)
    runners = args.runners.split(",")
    for runner in runners:
        print(f"running {runner} ...", flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), __file__, "--worker", runner, "--size", args.size, "--out", out_dir]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            print("\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    results = {r: [json.loads(Path(out_dir, f"{r}.{k}.json").read_text()) for k in (0, 1)]
               for r in runners if Path(out_dir, f"{r}.0.json").exists()}
    m = SIZES[args.size]
    print(f"\nLlama {m['hidden_size']}h x {m['num_hidden_layers']}L vocab {m['vocab_size']}, fp32 AdamW, micro-batch "
          f"{MICRO}x{SEQ}, 2 gloo ranks; MB per rank (rank 0 / rank 1)"
          + (f"; MALLOC_MMAP_THRESHOLD_={args.malloc_threshold}" if args.malloc_threshold else "") + "\n")
    fmt = lambda pair: f"{pair[0] / MB:7.1f} / {pair[1] / MB:7.1f}"  # noqa: E731
    for section in ("rss", "tensors"):
        keys = []
        for r in results.values():
            for k in r[0][section]:
                if k not in keys:
                    keys.append(k)
        print(f"{section.upper():44s} " + " ".join(f"{r:>17s}" for r in results))
        for k in keys:
            cells = [fmt([res[i][section].get(k, 0) for i in (0, 1)]) if k in res[0][section] else " " * 17
                     for res in results.values()]
            print(f"  {k:42s} " + " ".join(f"{c:>17s}" for c in cells))
        print()


if __name__ == "__main__":
    main()
