"""hf_zero's compiled kernels side by side with their peers, in one run (ratios, not absolute times).

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--threads 2] [--adam-mparams 8] [--repeat 9]

--device defaults to cuda when a GPU and hf_zero._C_cuda are there, else cpu.

On CUDA (times from CUDA events, median of --cuda-repeat calls after warm-up; before each timed call the stream
sleeps ~0.5 ms so that the host has queued the call before the GPU reaches it: the times are the GPU's, without
the host's launch overhead, which a training step hides behind earlier work; "synced" repeats the measurement
with a synchronize around each call, host overhead included):
  - fused Adam (FusedAdam: one multi-tensor launch) on --cuda-adam-mparams M fp32 params in --cuda-adam-tensors
    tensors against torch AdamW(fused=True), and its achieved bandwidth (read p, g, m, v; write p, m, v) against a
    device-to-device copy moving the same number of bytes (dst.copy_(src)), measured in the same run (target: 0.8x);
  - LayerNorm, RMSNorm and the residual-add variants on --cuda-rows x --cuda-hidden in bf16 and fp32, forward and
    forward+backward, against torch's native ops: F.layer_norm, F.rms_norm, and x + r followed by them (target:
    hf_zero <= 1.0x torch's time, issue #24).

On the CPU:

Adam (fp32 master params, flat partition of N parameters):
  - hf_zero adam_step_ vs DeepSpeedCPUAdam (run in /opt/dsvenv or $HF_ZERO_DS_PYTHON through a subprocess with the
    same thread count, if that interpreter has deepspeed), torch AdamW fused=True and foreach=True;
  - bytes each step must move (read p, g, m, v; write p, m, v) against this machine's measured copy bandwidth
    (best of a 2-buffer tensor copy and an in-place pass, both 2 threads);
  - bf16 grads + 16-bit param output in one pass vs torch fused AdamW plus the separate casts it needs.
Norms (forward, rows x hidden): LayerNorm, residual-add + LayerNorm, RMSNorm (LlamaRMSNorm), residual-add +
RMSNorm, each against the unfused torch sequence.

Times are the median of --repeat runs after warm-up; each pair is measured interleaved so drift hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_zero.ops import (  # noqa: E402
    FusedAdam,
    adam_step_,
    add_layer_norm,
    add_rms_norm,
    extension_status,
    layer_norm,
    native_available,
    rms_norm,
)
from hf_zero.ops.norm import rms_norm_reference  # noqa: E402

ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True, bias_correction=True)


def median_time(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns: dict[str, callable], repeat: int) -> dict[str, float]:
    """Median seconds per call of each fn, measured round-robin."""
    for fn in fns.values():
        fn()
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


# DeepSpeedCPUAdam and hf_zero's kernel timed round-robin in the DeepSpeed interpreter's process (its venv sees
# this torch through --system-site-packages; hf_zero is imported from this checkout), so both see the same load.
DS_SCRIPT = textwrap.dedent(
    """
    import json, statistics, sys, time, torch
    sys.path.insert(0, {repo!r})
    torch.set_num_threads({threads})
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from hf_zero.ops.adam import adam_step_
    p = torch.nn.Parameter(torch.randn({numel}))
    p.grad = torch.randn({numel})
    opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    q, g, m, v = torch.randn({numel}), torch.randn({numel}), torch.zeros({numel}), torch.zeros({numel})
    step = [0]
    def ours():
        step[0] += 1
        adam_step_(q, g, m, v, step=step[0], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                   adamw_mode=True, bias_correction=True)
    fns = {{"deepspeed": opt.step, "hf_zero": ours}}
    samples = {{k: [] for k in fns}}
    for _ in range(2):
        for fn in fns.values():
            fn()
    for _ in range({repeat}):
        for name, fn in fns.items():
            t0 = time.perf_counter(); fn(); samples[name].append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({{k: statistics.median(v) for k, v in samples.items()}}))
    """
)


def deepspeed_adam_seconds(numel: int, threads: int, repeat: int) -> tuple[dict[str, float] | None, str]:
    """{"deepspeed": s, "hf_zero": s} per step, measured together in the DeepSpeed interpreter, or a skip note."""
    python = os.environ.get("HF_ZERO_DS_PYTHON", "/opt/dsvenv/bin/python")
    if not Path(python).exists():
        return None, f"skipped: no DeepSpeed interpreter at {python} (set HF_ZERO_DS_PYTHON)"
    # DeepSpeed's op links the system libgomp, torch (and so hf_zero's kernels, via at::parallel_for) its bundled
    # one: two OpenMP thread pools in one process. With the default active wait policy each pool's idle threads
    # spin for a while after every step and steal the cores from the other; passive waiting makes the round-robin
    # fair to both (and costs microseconds against steps of milliseconds).
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    code = DS_SCRIPT.format(repo=str(Path(__file__).resolve().parents[1]), threads=threads, numel=numel,
                            repeat=repeat)
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd="/tmp", timeout=1800)
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), "DeepSpeedCPUAdam (same threads, same process as hf_zero)"
    tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
    return None, f"skipped: DeepSpeedCPUAdam failed ({tail[0]})"


def bench_adam(numel: int, threads: int, repeat: int) -> None:
    print(f"\n== Adam step, {numel / 1e6:.1f} M fp32 params, {threads} threads ==")
    torch.manual_seed(0)
    p, g = torch.randn(numel), torch.randn(numel)
    m, v = torch.zeros(numel), torch.zeros(numel)
    step = [0]

    def ours():
        step[0] += 1
        adam_step_(p, g, m, v, step=step[0], **ADAM)

    def torch_opt(**flags):
        param = torch.nn.Parameter(torch.randn(numel))
        param.grad = torch.randn(numel)
        opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **flags)
        return opt.step

    # Bandwidth reference, measured in the same round-robin so machine load hits it and the kernels alike: the
    # faster of a tensor copy and an in-place read-modify-write pass (Adam updates p, m, v in place, which spares
    # the write-allocate reads a copy into another buffer pays), each counted as bytes read + written.
    copy_src = torch.ones(numel * 2)
    copy_dst = torch.empty_like(copy_src)
    times = interleaved({"hf_zero": ours, "torch fused": torch_opt(fused=True),
                         "torch foreach": torch_opt(foreach=True), "copy": lambda: copy_dst.copy_(copy_src),
                         "in-place": lambda: copy_dst.mul_(1.0)}, repeat)
    copy_bytes = 2 * copy_src.numel() * 4
    bandwidth = max(copy_bytes / times.pop("copy"), copy_bytes / times.pop("in-place"))
    ds_seconds, ds_note = deepspeed_adam_seconds(numel, threads, repeat)
    bytes_per_param = 4 * 4 + 3 * 4  # read p, g, m, v; write p, m, v

    def row(name, seconds):
        rate = numel / seconds / 1e6
        pct = 100 * bytes_per_param * numel / seconds / bandwidth
        print(f"  {name:<24} {seconds * 1e3:8.2f} ms  {rate:8.1f} Mparam/s  {pct:5.1f}% of copy bandwidth")

    for name, seconds in times.items():
        row(name, seconds)
    if ds_seconds is not None:
        row("DeepSpeedCPUAdam", ds_seconds["deepspeed"])
    else:
        print(f"  DeepSpeedCPUAdam         {ds_note}")
    print(f"  copy bandwidth           {bandwidth / 1e9:.2f} GB/s (read + write, best of copy / in-place pass)")
    if ds_seconds is not None:
        ratio = ds_seconds["deepspeed"] / ds_seconds["hf_zero"]
        print(f"  ratio vs DeepSpeedCPUAdam      {ratio:.2f}x  (target >= 1.15x; both timed in the DeepSpeed process)")
    print(f"  ratio vs torch fused AdamW     {times['torch fused'] / times['hf_zero']:.2f}x")
    print(f"  ratio vs torch foreach AdamW   {times['torch foreach'] / times['hf_zero']:.2f}x")
    pct = 100 * bytes_per_param * numel / times["hf_zero"] / bandwidth
    print(f"  hf_zero share of copy bandwidth {pct:.1f}%  (target >= 85%)")


def bench_adam_16bit(numel: int, threads: int, repeat: int) -> None:
    print(f"\n== Adam step with bf16 grads and a bf16 param copy, {numel / 1e6:.1f} M params ==")
    torch.manual_seed(0)
    p, m, v = torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    g16 = torch.randn(numel).to(torch.bfloat16)
    p16 = torch.empty(numel, dtype=torch.bfloat16)
    step = [0]

    def ours():
        step[0] += 1
        adam_step_(p, g16, m, v, step=step[0], out16=p16, **ADAM)

    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.zeros(numel)
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)
    q16 = torch.empty(numel, dtype=torch.bfloat16)

    def torch_sequence():
        param.grad.copy_(g16)  # upcast the 16-bit gradient
        opt.step()
        q16.copy_(param.detach())  # downcast for the 16-bit model copy

    times = interleaved({"hf_zero": ours, "torch": torch_sequence}, repeat)
    print(f"  hf_zero one pass               {times['hf_zero'] * 1e3:8.2f} ms")
    print(f"  torch cast + fused AdamW + cast {times['torch'] * 1e3:8.2f} ms")
    print(f"  ratio                          {times['torch'] / times['hf_zero']:.2f}x  (target >= 1.3x)")


def bench_norms(rows: int, hidden: int, repeat: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        print(f"\n== Norm forward, ({rows}, {hidden}) {str(dtype).replace('torch.', '')} ==")
        torch.manual_seed(0)
        x = torch.randn(rows, hidden).to(dtype)
        r = torch.randn(rows, hidden).to(dtype)
        w = torch.rand(hidden).to(dtype)
        b = torch.rand(hidden).to(dtype)
        pairs = {
            "LayerNorm": (lambda: layer_norm(x, w, b, 1e-5), lambda: F.layer_norm(x, (hidden,), w, b, 1e-5)),
            "residual add + LayerNorm": (lambda: add_layer_norm(x, r, w, b, 1e-5),
                                         lambda: F.layer_norm(x + r, (hidden,), w, b, 1e-5)),
            "RMSNorm (Llama)": (lambda: rms_norm(x, w, 1e-6), lambda: rms_norm_reference(x, w, 1e-6)),
            "residual add + RMSNorm": (lambda: add_rms_norm(x, r, w, 1e-6),
                                       lambda: rms_norm_reference(x + r, w, 1e-6)),
        }
        targets = {"LayerNorm": 1.0, "residual add + LayerNorm": 1.3, "residual add + RMSNorm": 1.3}
        with torch.no_grad():
            for name, (fused, unfused) in pairs.items():
                times = interleaved({"hf_zero": fused, "torch": unfused}, repeat)
                target = f"  (target >= {targets[name]}x)" if name in targets else ""
                print(f"  {name:<26} hf_zero {times['hf_zero'] * 1e3:7.3f} ms  torch {times['torch'] * 1e3:7.3f} ms"
                      f"  ratio {times['torch'] / times['hf_zero']:.2f}x{target}")


def cuda_times_ms(fns: dict[str, callable], repeat: int, synced: bool = False) -> dict[str, float]:
    """Median milliseconds per call of each fn on the current CUDA stream, the fns interleaved call by call.

    Default: each timed call follows a device-side sleep (~0.5 ms at H100 clocks) with no host synchronisation, so
    the host has enqueued the call before the GPU gets to it and the events bracket GPU work only. synced=True:
    synchronize before each call, so the host's time to the first launch counts too."""
    for fn in fns.values():  # warm-up: compile caches, allocator pools, occupancy queries
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    events: dict[str, list] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if synced:
                torch.cuda.synchronize()
            else:
                torch.cuda._sleep(1_000_000)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
            if synced:
                torch.cuda.synchronize()
    torch.cuda.synchronize()
    return {k: statistics.median(a.elapsed_time(b) for a, b in v) for k, v in events.items()}


def bench_adam_cuda(mparams: float, tensors: int, repeat: int, device: str = "cuda") -> None:
    numel_each = int(mparams * 1e6 / tensors)
    numel = numel_each * tensors
    print(f"\n== CUDA Adam step, {numel / 1e6:.1f} M fp32 params in {tensors} tensors ==")

    def make(seed):
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(numel_each, device=device) * 0.02) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        return params

    ours = FusedAdam(make(1), lr=1e-3, weight_decay=0.01)
    theirs = torch.optim.AdamW(make(1), lr=1e-3, weight_decay=0.01, fused=True)
    bytes_per_step = numel * 4 * 7  # read p, g, m, v; write p, m, v
    # A copy moving as many bytes (half read, half written): the bandwidth the step can hope for on this GPU.
    copy_src = torch.ones(bytes_per_step // 2 // 4, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_bytes = 2 * copy_src.numel() * 4
    ms = cuda_times_ms({"hf_zero": ours.step, "torch fused": theirs.step,
                        "copy": lambda: copy_dst.copy_(copy_src)}, repeat)
    adam_bw = bytes_per_step / (ms["hf_zero"] * 1e-3)
    copy_bw = copy_bytes / (ms["copy"] * 1e-3)
    torch_bw = bytes_per_step / (ms["torch fused"] * 1e-3)
    print(f"  hf_zero FusedAdam      {ms['hf_zero']:8.3f} ms  {adam_bw / 1e12:6.2f} TB/s")
    print(f"  torch AdamW fused      {ms['torch fused']:8.3f} ms  {torch_bw / 1e12:6.2f} TB/s")
    print(f"  copy_ ({copy_bytes / 1e9:.2f} GB moved)  {ms['copy']:8.3f} ms  {copy_bw / 1e12:6.2f} TB/s")
    print(f"  hf_zero / copy bandwidth       {adam_bw / copy_bw:.2f}x  (target >= 0.8x)")
    print(f"  torch fused time / hf_zero time {ms['torch fused'] / ms['hf_zero']:.2f}x")


def bench_norms_cuda(rows: int, hidden: int, repeat: int, device: str = "cuda") -> None:
    for dtype in (torch.bfloat16, torch.float32):
        print(f"\n== CUDA norms, ({rows}, {hidden}) {str(dtype).replace('torch.', '')}: hf_zero vs torch native "
              f"(ms; ratio = hf_zero / torch, target <= 1.0) ==")
        torch.manual_seed(0)
        x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
        r = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
        w = (torch.rand(hidden, device=device) + 0.5).to(dtype).requires_grad_()
        b = torch.randn(hidden, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(rows, hidden, device=device, dtype=dtype)
        g_sum = torch.randn(rows, hidden, device=device, dtype=dtype)

        def torch_add_ln():
            s = x + r
            return F.layer_norm(s, (hidden,), w, b, 1e-5), s

        def torch_add_rms():
            s = x + r
            return F.rms_norm(s, (hidden,), w, 1e-6), s

        # name: (hf_zero fn, torch fn, inputs); an fn returns one output or (out, x + r)
        cases = {
            "LayerNorm": (lambda: layer_norm(x, w, b, 1e-5), lambda: F.layer_norm(x, (hidden,), w, b, 1e-5),
                          (x, w, b)),
            "RMSNorm": (lambda: rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (hidden,), w, 1e-6), (x, w)),
            "add + LayerNorm": (lambda: add_layer_norm(x, r, w, b, 1e-5), torch_add_ln, (x, r, w, b)),
            "add + RMSNorm": (lambda: add_rms_norm(x, r, w, 1e-6), torch_add_rms, (x, r, w)),
        }

        def fwd_bwd(fn, inputs):
            def run():
                out = fn()
                outs = list(out) if isinstance(out, tuple) else [out]
                torch.autograd.grad(outs, inputs, [g, g_sum][:len(outs)])
            return run

        print(f"  {'op':<16} {'pass':<8} {'hf_zero':>8} {'torch':>8} {'ratio':>6}   {'synced: hf_zero':>15} "
              f"{'torch':>8} {'ratio':>6}   max |diff| / max |torch|")
        for name, (ours, theirs, inputs) in cases.items():
            with torch.no_grad():
                a, c = ours(), theirs()
                a, c = (a[0], c[0]) if isinstance(a, tuple) else (a, c)
                err = ((a.float() - c.float()).abs().max() / c.float().abs().max()).item()
            for label, pair in (("fwd", (ours, theirs)), ("fwd+bwd", (fwd_bwd(ours, inputs), fwd_bwd(theirs, inputs)))):
                ms = cuda_times_ms({"hf_zero": pair[0], "torch": pair[1]}, repeat)
                synced = cuda_times_ms({"hf_zero": pair[0], "torch": pair[1]}, repeat, synced=True)
                line = (f"  {name:<16} {label:<8} {ms['hf_zero']:8.3f} {ms['torch']:8.3f} "
                        f"{ms['hf_zero'] / ms['torch']:6.2f}   {synced['hf_zero']:15.3f} {synced['torch']:8.3f} "
                        f"{synced['hf_zero'] / synced['torch']:6.2f}")
                print(line + (f"   {err:.1e}" if label == "fwd" else ""))
        del x, r, w, b, g, g_sum
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda_ready = torch.cuda.is_available() and native_available("cuda")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda_ready else "cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--adam-mparams", type=float, default=8.0, help="CPU Adam partition size in millions")
    parser.add_argument("--rows", type=int, default=4096, help="CPU norm rows")
    parser.add_argument("--hidden", type=int, default=1024, help="CPU norm hidden size")
    parser.add_argument("--repeat", type=int, default=9, help="CPU timing repeats")
    parser.add_argument("--cuda-adam-mparams", type=float, default=160.0, help="CUDA Adam params in millions")
    parser.add_argument("--cuda-adam-tensors", type=int, default=120, help="CUDA Adam: how many tensors")
    parser.add_argument("--cuda-rows", type=int, default=16384, help="CUDA norm rows")
    parser.add_argument("--cuda-hidden", type=int, default=4096, help="CUDA norm hidden size")
    parser.add_argument("--cuda-repeat", type=int, default=20, help="CUDA timing repeats (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not cuda_ready:
            sys.exit("--device cuda: no CUDA GPU, or hf_zero._C_cuda is not loaded "
                     f"({extension_status('cuda').reason}); build it first (pip install --no-build-isolation -e .)")
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
        bench_adam_cuda(args.cuda_adam_mparams, args.cuda_adam_tensors, args.cuda_repeat)
        bench_norms_cuda(args.cuda_rows, args.cuda_hidden, args.cuda_repeat)
        return
    if not native_available("cpu"):
        sys.exit("hf_zero._C is not loaded: build it first (pip install --no-build-isolation -e .)")
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs")
    numel = int(args.adam_mparams * 1e6)
    bench_adam(numel, args.threads, args.repeat)
    bench_adam_16bit(numel, args.threads, args.repeat)
    bench_norms(args.rows, args.hidden, args.repeat)


if __name__ == "__main__":
    main()
