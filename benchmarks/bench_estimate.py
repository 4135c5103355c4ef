"""Predicted vs measured peak memory per rank (CPU: VmHWM growth over the process after imports).

    OMP_NUM_THREADS=1 python benchmarks/bench_estimate.py [--models tiny,small] [--batches 4x256,8x256]

Each row trains a Llama built from config for 3 steps (fp32, AdamW, gradient clipping) on 1 or 2 gloo ranks and
compares the rank's VmHWM growth (measured from after ``import torch, transformers, hf_zero`` and process-group
init; ``/proc/self/clear_refs`` resets the high-water mark there) with ``hf_zero.profiling.estimate_memory``'s peak
for the same config. ``MALLOC_MMAP_THRESHOLD_=131072`` fixes glibc's heap growth (without it the measured peak keeps
rising step after step; the estimate states tensor bytes, not allocator headroom). The machine is shared: RSS is
not affected by load, times are.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned ranks

MODELS = {
    "tiny": dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4),
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8),
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _rank_run(model_name: str, ds: dict, batch: int, seq: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero
    from hf_zero.profiling.memory import estimate_memory

    cfg = LlamaConfig(max_position_embeddings=max(seq, 512), tie_word_embeddings=False, **MODELS[model_name])
    cfg._attn_implementation = "sdpa"
    world = dist.get_world_size()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    engine, *_ = hf_zero.initialize(model=model, config=ds)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    measured = _status("VmHWM") - base
    engine.destroy()
    est = estimate_memory(cfg, ds, world_size=world, micro_batch=batch, seq_len=seq, accelerator="cpu")
    return {"measured": measured, "predicted": est.peak("accelerator"), "states": est.model_states()}


def _config(stage: int, offload: str, batch: int, nvme_dir: str) -> dict:
    ds = {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}
    if offload == "cpu":
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        ds["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
    return ds


def main(argv=None) -> int:
    from hf_zero.testing import run_distributed

    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny")
    p.add_argument("--batches", default="4x256,8x256")
    p.add_argument("--worlds", default="1,2")
    args = p.parse_args(argv)
    rows = []
    nvme = tempfile.mkdtemp(prefix="hfz_bench_nvme_")
    runs = [(s, "none") for s in (0, 1, 2, 3)] + [(2, "cpu"), (3, "cpu"), (3, "nvme")]
    print(f"{'model':<6} {'stage':>5} {'offload':>7} {'world':>5} {'batch':>7} {'rank':>4} {'measured MiB':>13} "
          f"{'predicted MiB':>14} {'error':>7}")
    for model_name in args.models.split(","):
        for shape in args.batches.split(","):
            batch, seq = (int(x) for x in shape.split("x"))
            for world in (int(w) for w in args.worlds.split(",")):
                for stage, offload in runs:
                    ds = _config(stage, offload, batch, nvme)
                    try:
                        results = run_distributed(_rank_run, world, args=(model_name, ds, batch, seq), timeout_s=900)
                    except Exception as err:  # noqa: BLE001 -- a failed row is reported, the table goes on
                        print(f"{model_name:<6} {stage:>5} {offload:>7} {world:>5} {shape:>7}  failed: "
                              f"{str(err).splitlines()[0]}")
                        continue
                    for rank, r in enumerate(results):
                        err = (r["predicted"] - r["measured"]) / r["measured"]
                        rows.append(err)
                        print(f"{model_name:<6} {stage:>5} {offload:>7} {world:>5} {shape:>7} {rank:>4} "
                              f"{r['measured'] / 2**20:>13.1f} {r['predicted'] / 2**20:>14.1f} {100 * err:>6.1f}%",
                              flush=True)
    if rows:
        print(f"rows {len(rows)}: max |error| {100 * max(abs(e) for e in rows):.1f}%, mean |error| "
              f"{100 * sum(abs(e) for e in rows) / len(rows):.1f}%, worst under-prediction "
              f"{100 * min(rows):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
