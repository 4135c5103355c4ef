"""``hf-zero estimate``: memory per rank and step time of a training run, from a model config and a DeepSpeed config.

    hf-zero estimate --model-config path/to/config.json --ds-config ds_config.json --world-size 8 \\
        --micro-batch 4 --seq-len 2048 [--json] [--sweep] [--device-memory-gib 80]

Nothing is downloaded and no weights are read: the model is built on the meta device from its config, its
activations traced under FakeTensorMode (see hf_zero/profiling/memory.py for what is counted).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch

__all__ = ["add_parser", "run"]

_GIB = 2**30


def add_parser(commands) -> None:
    p = commands.add_parser("estimate", help="predict memory per rank and step time from a model config and a "
                                             "DeepSpeed config (no weights, no downloads)")
    p.add_argument("model", nargs="?", default=None, help="the model: a transformers config.json or a directory "
                   "holding one, given positionally as to `accelerate estimate-memory` (or with --model-config)")
    p.add_argument("--model-config", default=None, help="the same, as a flag")
    p.add_argument("--ds-config", help="the DeepSpeed / hf_zero JSON config you will run (default: stage 0, fp32)")
    p.add_argument("--world-size", type=int, default=None, help="data-parallel ranks (default: nproc x nnodes)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per micro-step "
                                                                 "(default: the config's, 1 if auto)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--trainable", default=None, help="regex: only parameters whose name matches train "
                                                     "(the rest are frozen)")
    p.add_argument("--lora-targets", default=None, help="comma-separated module names to give LoRA adapters "
                                                        "(e.g. q_proj,v_proj): only the adapters train")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (with --lora-targets)")
    p.add_argument("--accelerator", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--device-memory-gib", type=float, default=None, help="memory of one accelerator "
                                                                         "(default: detected)")
    p.add_argument("--host-memory-gib", type=float, default=None, help="host RAM per node (default: detected)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak of one device (default: table)")
    p.add_argument("--sweep", action="store_true", help="try stages 0-3, offload none/cpu, micro batches up to "
                                                        "--micro-batch and gradient checkpointing; rank what fits")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(re.search(r"MemTotal:\s+(\d+) kB", f.read()).group(1)) * 1024
    except (OSError, AttributeError):
        return 0


def _device_memory(accelerator: str) -> int:
    if accelerator == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return _host_memory()


def _variant(ds: dict, stage: int, offload: str, micro: int) -> dict:
    out = json.loads(json.dumps(ds))
    zero = out.setdefault("zero_optimization", {})
    zero["stage"] = stage
    if offload == "none":
        zero.pop("offload_optimizer", None)
    else:
        zero["offload_optimizer"] = {"device": offload}
    out["train_micro_batch_size_per_gpu"] = micro
    return out


def _evaluate(config, model, ds: dict, args, world: int, micro: int, gc: bool, act_per_sample) -> dict:
    from hf_zero.profiling.analytic import analytic_flops, supports
    from hf_zero.profiling.hardware import peak_tflops
    from hf_zero.profiling.memory import compute_dtype, estimate_memory
    from hf_zero.profiling.params import count_params
    from hf_zero.profiling.steptime import estimate_step_time

    trainable = re.compile(args.trainable).search if args.trainable else None
    est = estimate_memory(model, ds, world_size=world, micro_batch=micro, seq_len=args.seq_len,
                          accelerator=args.accelerator, trainable=trainable, gradient_checkpointing=gc,
                          activations=act_per_sample.scaled(micro))
    dtype = compute_dtype(ds)
    counts = count_params(model)
    result = est.to_dict()
    device_mem = int(args.device_memory_gib * _GIB) if args.device_memory_gib else _device_memory(args.accelerator)
    host_mem = int(args.host_memory_gib * _GIB) if args.host_memory_gib else _host_memory()
    result["device_memory_bytes"] = device_mem
    result["fits"] = est.peak("accelerator") <= device_mem and est.peak("host") * args.nproc_per_node <= host_mem
    # loading: every local process materialises the full model (fp32 checkpoint) unless zero.Init shards it, into
    # shards of the training dtype (zero.Init casts them under bf16/fp16, as DeepSpeed's does)
    if int(ds.get("zero_optimization", {}).get("stage", 0)) == 3:
        per_process = counts.total * torch.empty(0, dtype=dtype).element_size() // world
    else:
        per_process = counts.total * 4
    result["host_bytes_while_loading"] = per_process * args.nproc_per_node
    peak = peak_tflops(args.accelerator if args.accelerator == "cuda" else "cpu", dtype, override=args.peak_tflops)
    if peak and config is not None and supports(config):
        gas = ds.get("gradient_accumulation_steps")
        gas = int(gas) if gas not in (None, "auto") else 1
        flops = analytic_flops(config, micro, args.seq_len).training * gas
        if gc:  # checkpointing re-runs the forward in backward: about a third more work
            flops = flops * 4 / 3
        zero = ds.get("zero_optimization", {})
        result["step_time_s"] = estimate_step_time(
            flops, params=counts.total, trainable=counts.trainable, stage=int(zero.get("stage", 0)),
            world_size=world, peak_tflops=peak, param_bytes=torch.empty(0, dtype=dtype).element_size(),
            offload_optimizer=(zero.get("offload_optimizer") or {}).get("device", "none"))
        result["tokens_per_s"] = micro * args.seq_len * world / result["step_time_s"]["step"]
    result["table"] = est.table()
    return result


def run(args: argparse.Namespace) -> int:
    from hf_zero.profiling.activations import activation_profile
    from hf_zero.profiling.memory import build_meta_model, compute_dtype, load_model_config, read_ds_config

    if args.model is not None and args.model_config is not None and args.model != args.model_config:
        print(f"hf-zero estimate: got the model twice ({args.model!r} and --model-config {args.model_config!r}); "
              "give it once", file=sys.stderr)
        return 2
    source = args.model_config if args.model_config is not None else args.model
    if source is None:
        print("hf-zero estimate: which model? Give its config.json or a directory holding one: "
              "`hf-zero estimate path/to/model --ds-config ds.json` (or --model-config)", file=sys.stderr)
        return 2
    if args.accelerator is None:
        args.accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    config = load_model_config(source)
    lora = ({"r": args.lora_r, "target_modules": [t.strip() for t in args.lora_targets.split(",") if t.strip()]}
            if args.lora_targets else None)
    model = build_meta_model(config, lora)
    ds = read_ds_config(args.ds_config)
    world = args.world_size or args.nproc_per_node * args.nnodes
    cfg_micro = ds.get("train_micro_batch_size_per_gpu")
    micro = args.micro_batch or (int(cfg_micro) if cfg_micro not in (None, "auto") else 1)
    dtype = compute_dtype(ds)
    trainable = re.compile(args.trainable).search if args.trainable else None
    # activations are linear in the batch: trace one sequence per checkpointing setting, scale by micro batch
    per_sample = {gc: activation_profile(config, 1, args.seq_len, dtype=dtype, gradient_checkpointing=gc,
                                         trainable=trainable, lora=lora)
                  for gc in ((False, True) if args.sweep else (args.gradient_checkpointing,))}
    if not args.sweep:
        result = _evaluate(config, model, ds, args, world, micro, args.gradient_checkpointing,
                           per_sample[args.gradient_checkpointing])
        if args.json:
            result.pop("table")
            print(json.dumps(result, indent=2))
        else:
            _print_one(result, args)
        return 0 if result["fits"] else 1
    rows = []
    for stage in (0, 1, 2, 3):
        for offload in ("none", "cpu"):
            if stage == 0 and offload != "none":
                continue
            m = 1
            while m <= micro:
                for gc in (False, True):
                    r = _evaluate(config, model, _variant(ds, stage, offload, m), args, world, m, gc, per_sample[gc])
                    rows.append({"stage": stage, "offload_optimizer": offload, "micro_batch": m,
                                 "gradient_checkpointing": gc, "peak_accelerator_bytes": r["peak_bytes"]["accelerator"],
                                 "peak_host_bytes": r["peak_bytes"]["host"], "fits": r["fits"],
                                 "step_time_s": (r.get("step_time_s") or {}).get("step"),
                                 "tokens_per_s": r.get("tokens_per_s")})
                m *= 2
    fitting = [r for r in rows if r["fits"]]
    timed = any(r["tokens_per_s"] for r in fitting)  # (list.sort empties the list while it sorts)
    fitting.sort(key=lambda r: -(r["tokens_per_s"] or 0) if timed else r["peak_accelerator_bytes"])
    if args.json:
        print(json.dumps({"fits": fitting, "all": rows}, indent=2))
    else:
        print(f"{'rank':>4} {'stage':>5} {'offload':>8} {'micro':>5} {'ckpt':>5} {'peak GiB':>9} {'tokens/s':>10}")
        for i, r in enumerate(fitting, 1):
            tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "n/a"
            print(f"{i:>4} {r['stage']:>5} {r['offload_optimizer']:>8} {r['micro_batch']:>5} "
                  f"{'yes' if r['gradient_checkpointing'] else 'no':>5} "
                  f"{r['peak_accelerator_bytes'] / _GIB:>9.2f} {tps:>10}")
        print(f"{len(fitting)} of {len(rows)} configurations fit"
              + ("" if any(r["tokens_per_s"] for r in fitting) else
                 " (ranked by memory: no peak FLOP/s known for this device; pass --peak-tflops for step times)"))
    return 0 if fitting else 1


def _print_one(result: dict, args) -> None:
    inp = result["inputs"]
    print(f"hf-zero estimate: {inp['params'] / 1e6:.2f}M params ({inp['trainable_params'] / 1e6:.2f}M trainable), "
          f"ZeRO stage {inp['stage']}, {inp['dtype']}, world size {inp['world_size']}, micro batch "
          f"{inp['micro_batch']} x {inp['seq_len']} tokens, offload optimizer={inp['offload_optimizer']} "
          f"param={inp['offload_param']}, accelerator {inp['accelerator']}")
    print(result["table"])
    dev = result["device_memory_bytes"]
    peak = result["peak_bytes"]["accelerator"]
    verdict = "fits" if result["fits"] else "does NOT fit"
    print(f"{verdict}: peak {peak / _GIB:.2f} GiB per rank against {dev / _GIB:.2f} GiB "
          f"({'given' if args.device_memory_gib else 'detected'})")
    print(f"host RAM while loading the checkpoint: {result['host_bytes_while_loading'] / _GIB:.2f} GiB per node")
    st = result.get("step_time_s")
    if st:
        print("step time (roofline, uncalibrated): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in st.items())
              + f"; {result['tokens_per_s']:.0f} tokens/s")
    else:
        print("step time: no dense peak FLOP/s known for this device (pass --peak-tflops)")
    print("allocator headroom not included (CPU: glibc heap growth; GPU: caching allocator reserve)")

