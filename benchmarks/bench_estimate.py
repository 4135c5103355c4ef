"""Predicted vs measured peak memory per rank (CPU: VmHWM growth over the process after imports), step time.

    OMP_NUM_THREADS=1 python benchmarks/bench_estimate.py [--models tiny,small] [--batches 1x128,2x128] \
        [--worlds 1,2] [--runs 3:none,3:cpu] [--save runs.json] [--load runs.json] \
        [--ds-python /work/venvs/ds/bin/python]

Each run trains a Llama built from config for ``--steps`` steps (fp32, AdamW, gradient clipping) on 1 or 2 gloo
ranks and records each rank's VmHWM growth (from after ``import torch, transformers, hf_zero`` and process-group
init; ``/proc/self/clear_refs`` resets the high-water mark there) and its step times. The ranks of every run are
forked from this process, which imported everything once (spawning fresh ranks costs ~40 s of imports per run on
the loaded host). A forked rank measures up to ~10 MiB more than a spawned one (tiny Llama, 2 ranks, stage 0:
203.8 forked vs 193.7 spawned): the table errs toward showing under-prediction. A process that trained before
measures ~25 MiB less (the runtime's one-time growth), so no run reuses one. The prediction is
``hf_zero.profiling.estimate_memory(config, ds_config, world_size, micro_batch, seq_len).peak("accelerator")``,
computed in this process from the config alone (no weights). ``--save`` keeps the measurements, ``--load`` prints the
table again from them with the current estimator (no training).

``MALLOC_MMAP_THRESHOLD_=131072`` is exported to the ranks: without it glibc's dynamic mmap threshold keeps large
freed blocks in the heap and the measured peak rises step after step (the estimate states tensor bytes, not
allocator headroom). RSS is not affected by the machine's load; step times are (this machine is shared).

Step time: the engine's own calibrated roofline (``engine.step_time_model``, fitted to its first measured steps
after a warm-up) predicts the last step; a second column calibrates once per model and batch shape on the stage-0
one-rank run and predicts every other configuration from the roofline alone.

With ``--ds-python`` (a virtual environment with a real DeepSpeed, ``DS_ACCELERATOR=cpu``) a second table puts
hf_zero's counted FLOPs and parameter totals beside DeepSpeed's ``get_model_profile`` (stage 0 and under
``zero.Init``) and its ``estimate_zero2/3_model_states_mem_needs_all_live`` on the same models.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

MODELS = {
    "tiny": dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8),
}
RUNS = [(s, "none") for s in (0, 1, 2, 3)] + [(2, "cpu"), (3, "cpu"), (3, "nvme")]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def llama_config(model_name: str, seq: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(max_position_embeddings=max(seq, 512), tie_word_embeddings=False, **MODELS[model_name])
    cfg._attn_implementation = "sdpa"
    return cfg


def _job(model_name: str, ds: dict, batch: int, seq: int, steps: int, count: bool = False) -> dict:
    """One training run on this rank (a forked child with its own process group): VmHWM growth and step times;
    with ``count``, after the measurement, the FLOPs of one more forward + backward counted by hf_zero's counter and
    the parameter total it reads (true sizes under ZeRO-3)."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import hf_zero

    cfg = llama_config(model_name, seq)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    engine, *_ = hf_zero.initialize(model=model, config=ds)
    g = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        times.append(time.perf_counter() - start)
    measured = _status("VmHWM") - base
    calibrated = engine.step_time_model
    out = {"measured": measured, "step_s": times,
           "engine_predicted_s": calibrated.predicted_step_s if calibrated is not None else None}
    if count:
        from hf_zero.profiling import FlopCounter, count_params

        counter = FlopCounter(engine.module)
        with counter.window("forward"):
            loss = engine(input_ids=ids, labels=ids).loss
        with counter.window("backward"):
            engine.backward(loss)
        out.update(counted_flops=counter.report.model, counted_forward=counter.report.forward,
                   params=count_params(engine.module).total)
    engine.destroy()
    return out


def _forked(world: int, job: tuple, timeout_s: float) -> list[dict]:
    """Run ``_job(*job)`` on ``world`` ranks forked from this process (the imports are paid once, here), each with
    a gloo process group of its own; a rank's memory growth is its own training run's."""
    import torch.distributed as dist

    from hf_zero.testing import free_port

    port = free_port()
    children = []
    for rank in range(world):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one rank of this job, then exit without running the parent's cleanup
            os.close(read_fd)
            try:
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                  WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
                dist.init_process_group("gloo", rank=rank, world_size=world)
                payload = json.dumps(_job(*job))
                dist.destroy_process_group()
            except BaseException as err:  # noqa: BLE001 -- reported to the parent as this rank's result
                payload = json.dumps({"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"})
            with os.fdopen(write_fd, "w") as f:
                f.write(payload)
            os._exit(0)
        os.close(write_fd)
        children.append((pid, read_fd))
    deadline = time.monotonic() + timeout_s
    results = []
    for pid, read_fd in children:
        ready, _, _ = select.select([read_fd], [], [], max(deadline - time.monotonic(), 0))
        data = None
        if not ready:
            for other, _ in children:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            results.append({"error": f"timed out after {timeout_s:.0f} s"})
        else:
            with os.fdopen(read_fd) as f:
                data = f.read()
            results.append(json.loads(data) if data else {"error": "rank exited without a result"})
        os.waitpid(pid, 0)
    return results


def ds_config(stage: int, offload: str, batch: int, nvme_dir: str) -> dict:
    ds = {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}
    if offload == "cpu":
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        ds["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
    return ds


def runs_of(spec: str | None) -> list[tuple[int, str]]:
    """``--runs`` ("3:none,3:cpu"): the (stage, offload) rows to measure; every row of RUNS by default."""
    if not spec:
        return RUNS
    picked = [(int(stage), offload) for stage, offload in (item.split(":") for item in spec.split(","))]
    unknown = [r for r in picked if r not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: {unknown} not among {RUNS}")
    return picked


def measure(args) -> list[dict]:
    import torch  # noqa: F401 -- imported once here, inherited by every forked rank
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import hf_zero  # noqa: F401

    nvme = tempfile.mkdtemp(prefix="hfz_bench_nvme_")
    runs = []
    worlds = [int(w) for w in args.worlds.split(",")]
    for world in worlds:
        for model_name in args.models.split(","):
            for shape in args.batches.split(","):
                batch, seq = (int(x) for x in shape.split("x"))
                for stage, offload in runs_of(args.runs):
                    run = dict(model=model_name, batch=batch, seq=seq, world=world, stage=stage, offload=offload)
                    count = offload == "none" and stage in (0, 3) and world == max(worlds)
                    results = _forked(world, (model_name, ds_config(stage, offload, batch, nvme), batch, seq,
                                              args.steps, count), timeout_s=1800)
                    failed = [r["error"] for r in results if "error" in r]
                    if failed:
                        run["error"] = failed[0]
                    else:
                        run["ranks"] = results
                    print(f"measured {model_name} {shape} world {world} stage {stage} offload {offload}: "
                          f"{[round(r['measured'] / 2**20, 1) for r in results if 'measured' in r] or failed}",
                          file=sys.stderr, flush=True)
                    runs.append(run)
                    if args.save:  # after every run: a long matrix interrupted keeps what it measured
                        with open(args.save, "w") as f:
                            json.dump(runs, f, indent=1)
    return runs


def predict(run: dict) -> dict:
    from hf_zero.profiling.analytic import analytic_flops
    from hf_zero.profiling.memory import estimate_memory

    cfg = llama_config(run["model"], run["seq"])
    ds = ds_config(run["stage"], run["offload"], run["batch"], "/tmp")
    est = estimate_memory(cfg, ds, world_size=run["world"], micro_batch=run["batch"], seq_len=run["seq"],
                          accelerator="cpu")
    flops = analytic_flops(cfg, run["batch"], run["seq"]).training
    return {"peak": est.peak("accelerator"), "flops": flops, "params": est.inputs["params"]}


def _workload(run: dict, pred: dict) -> dict:
    return dict(model_flops_per_rank=pred["flops"], params=pred["params"], trainable=pred["params"],
                stage=run["stage"], world_size=run["world"], param_bytes=4,
                offload_optimizer=run["offload"] if run["offload"] != "nvme" else "nvme")


def memory_table(runs: list[dict]) -> list[float]:
    from hf_zero.profiling.steptime import Hardware, StepTimeModel

    # cross-config step time: one calibration per (model, batch shape) on its stage-0 one-rank run, on this CPU
    cpu = StepTimeModel(Hardware(peak_tflops=1.0, mem_bw_gbs=10.0, bus_bw_gbs=2.0, pcie_gbs=10.0, nvme_gbs=1.0,
                                 host_bw_gbs=10.0))
    anchors = {}
    for run in runs:
        if run["stage"] == 0 and run["world"] == 1 and "ranks" in run and len(run["ranks"][0]["step_s"]) > 1:
            pred = predict(run)
            anchors[(run["model"], run["batch"], run["seq"])] = cpu.calibrate(
                run["ranks"][0]["step_s"][1:], **_workload(run, pred))
    print(f"{'model':<6} {'stage':>5} {'offload':>7} {'world':>5} {'batch':>7} {'rank':>4} {'measured MiB':>13} "
          f"{'predicted MiB':>14} {'error':>7} | {'last step s':>11} {'engine-cal s':>12} {'cross-cal s':>11}")
    errors = []
    for run in runs:
        shape = f"{run['batch']}x{run['seq']}"
        head = f"{run['model']:<6} {run['stage']:>5} {run['offload']:>7} {run['world']:>5} {shape:>7}"
        if "error" in run:
            print(f"{head}  failed: {run['error']}")
            continue
        pred = predict(run)
        anchor = anchors.get((run["model"], run["batch"], run["seq"]))
        cross = anchor.breakdown(**_workload(run, pred))["step"] if anchor is not None else None
        for rank, r in enumerate(run["ranks"]):
            err = (pred["peak"] - r["measured"]) / r["measured"]
            errors.append(err)
            eng = r.get("engine_predicted_s")
            last = r["step_s"][-1] if r["step_s"] else None
            cols = [f"{v:>{w}.2f}" if v is not None else f"{'-':>{w}}" for v, w in ((last, 11), (eng, 12), (cross, 11))]
            print(f"{head} {rank:>4} {r['measured'] / 2**20:>13.1f} {pred['peak'] / 2**20:>14.1f} {100 * err:>6.1f}% | "
                  + " ".join(cols))
    if errors:
        print(f"rows {len(errors)}: max |error| {100 * max(abs(e) for e in errors):.1f}%, mean |error| "
              f"{100 * sum(abs(e) for e in errors) / len(errors):.1f}%, worst under-prediction "
              f"{100 * min(errors):.1f}%, rows within 15%: {sum(abs(e) <= 0.15 for e in errors)}/{len(errors)}")
    return errors


def deepspeed_table(runs: list[dict], ds_python: str | None, ds_results: str | None, shape: str) -> None:
    """hf_zero's counted FLOPs, parameter totals and estimates beside DeepSpeed's, per model, at ``shape``."""
    import torch
    from transformers import LlamaForCausalLM

    from hf_zero.profiling import count_flops, count_params
    from hf_zero.profiling.analytic import analytic_flops
    from hf_zero.profiling.memory import estimate_memory

    batch, seq = (int(x) for x in shape.split("x"))
    models = list(dict.fromkeys(r["model"] for r in runs))
    worlds = [r["world"] for r in runs]
    world = max(worlds) if worlds else 2
    ds = {}
    if ds_results:
        for path in ds_results.split(","):
            with open(path) as f:
                ds.update(json.loads(f.read().strip().splitlines()[-1]))
    elif ds_python:
        # one process per model: DeepSpeed's zero.Init leaves F.linear patched for the rest of the process, so a
        # later plain model would be counted through zero3_linear_wrap (twice) as well
        for model_name in models:
            proc = subprocess.run([ds_python, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                           "ds_reference.py"),
                                   json.dumps({model_name: MODELS[model_name]}), shape, str(world)],
                                  env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""},
                                  capture_output=True, text=True, timeout=3600)
            if proc.returncode == 0:
                ds.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            else:
                print(f"DeepSpeed reference for {model_name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    G, M = 1e9, 2**20
    print(f"\nFLOPs per training step (forward + backward, {shape}) and parameters; model states per rank on {world} "
          f"ranks (fp32 AdamW). hf_zero: counted at the dispatcher on the plain model and on a ZeRO-3 engine "
          f"({world} ranks, where that run was measured). DeepSpeed: get_model_profile on the plain model and "
          f"FlopsProfiler on a ZeRO-3 engine over a zero.Init model (1 gloo rank), training = 3 x forward; "
          f"estimate_zero2/3_model_states_mem_needs (no offload) from the true parameter count.")
    for model_name in models:
        cfg = llama_config(model_name, seq)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        counted = count_flops(model, input_ids=ids, labels=ids).model
        params = count_params(model).total
        del model
        z3 = next((r["ranks"][0] for r in runs if r["model"] == model_name and (r["batch"], r["seq"]) == (batch, seq)
                   and r["stage"] == 3 and "ranks" in r and "counted_flops" in r["ranks"][0]), None)
        d = ds.get(model_name)
        print(f"{model_name} ({params / 1e6:.2f}M params):")
        print(f"  FLOPs   analytic {analytic_flops(cfg, batch, seq).training / G:.3f} G | hf_zero counted: plain "
              f"{counted / G:.3f} G, ZeRO-3 " + (f"{z3['counted_flops'] / G:.3f} G" if z3 else "not run")
              + (f" | DeepSpeed: plain {3 * d['forward_flops'] / G:.3f} G, ZeRO-3 {3 * d['zero3_forward_flops'] / G:.3f} G"
                 if d else ""))
        print(f"  params  hf_zero: plain {params:,}, ZeRO-3 " + (f"{z3['params']:,}" if z3 else "not run")
              + (f" | DeepSpeed: profile plain {d['params']:,}, ZeRO-3 {d['zero3_params']:,}; model_to_params "
                 f"after zero.Init {d['zero3_model_to_params'][0]:,} (largest layer {d['zero3_model_to_params'][1]:,})"
                 if d else ""))
        for stage in (2, 3):
            est = estimate_memory(cfg, ds_config(stage, "none", batch, "/tmp"), world_size=world, micro_batch=batch,
                                  seq_len=seq, accelerator="cpu")
            measured = [max(x["measured"] for x in r["ranks"]) for r in runs
                        if "ranks" in r and (r["model"], r["batch"], r["seq"], r["world"], r["stage"], r["offload"])
                        == (model_name, batch, seq, world, stage, "none")]
            key = f"estimate_zero{stage}_gpu_bytes"
            print(f"  stage {stage}: hf_zero model states {est.model_states() / M:.1f} MiB, peak "
                  f"{est.peak('accelerator') / M:.1f} MiB; measured peak "
                  + (f"{measured[0] / M:.1f} MiB" if measured else "not run")
                  + (f" | DeepSpeed estimate_zero{stage}: {d[key] / M:.1f} MiB (model states only, 16-bit + Adam)"
                     if d else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--batches", default="1x128,2x128")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--runs", default=None, help="stage:offload rows to measure, e.g. 3:none,3:cpu (default: all)")
    p.add_argument("--save", default=None, help="write the measurements to this JSON file")
    p.add_argument("--load", default=None, help="print the table from measurements saved by --save (no training); "
                                                "several files separated by commas are concatenated")
    p.add_argument("--ds-python", default=None, help="python of a virtual environment with a real DeepSpeed")
    p.add_argument("--ds-results", default=None, help="outputs of benchmarks/ds_reference.py (comma-separated), instead of "
                                                      "running it")
    p.add_argument("--ds-shape", default="1x128", help="batch shape of the FLOPs / DeepSpeed table")
    args = p.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "131072" and not args.load:
        # glibc reads it when the process starts: run again with it (the forked ranks inherit the setting)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    if args.load:
        runs = []
        for path in args.load.split(","):
            with open(path) as f:
                runs += json.load(f)
    else:
        runs = measure(args)
    memory_table(runs)
    if args.ds_python or args.ds_results:
        deepspeed_table(runs, args.ds_python, args.ds_results, args.ds_shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
