"""CPU Adam: hf_zero's adam_step_ against DeepSpeedCPUAdam, same tensor sizes, same threads, one process.

    HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu /work/dsvenv/bin/python benchmarks/bench_cpu_adam.py \
        [--mparams 16] [--threads 1 2] [--repeat 40] [--states hf_zero|torch]

Each thread count runs in a child process of its own (OMP_NUM_THREADS set before either OpenMP runtime starts:
DeepSpeed's op links the system libgomp, torch its bundled one, and torch.set_num_threads reaches only the
latter). In the child both optimizers step round-robin, the order flipped every round, so they share whatever
load the machine carries; the table prints medians and hf_zero's speed-up (DeepSpeed's time / hf_zero's).

Cases, all on one flat partition of N parameters with AdamW (weight_decay 0.01, bias correction), fp32 states;
bytes moved per parameter in brackets:
  fp32    fp32 params and grads: adam_step_ / DeepSpeedCPUAdam.step on the same layout [28 / 28]
  bf16    bf16 params and grads, no fp32 master (DeepSpeedCPUAdam's bf16 path): adam_step_ on the bf16 param in
          place / DeepSpeedCPUAdam.step [22 / 22]
  out16   an fp32 master whose bf16 copy is refreshed every step (ZeRO-Offload's layout): adam_step_ with bf16 grads
          and out16 (one pass) / DeepSpeedCPUAdam.step on the fp32 master, then the copy to bf16, as DeepSpeed's
          engine does it [30 / 36]
  out16v  adam_step_'s out16 pass again / DeepSpeed's bf16 case: different jobs (DeepSpeed keeps no fp32 master,
          so it moves fewer bytes); printed because it is the pairing a user choosing "bf16" may compare [30 / 22]
Optimizer states: each optimizer's own. DeepSpeedCPUAdam allocates its exp_avg/exp_avg_sq itself (torch.zeros_like);
hf_zero's arm takes them from hf_zero.ops.adam.zeros_state, as CPUAdam does: 2 MiB-aligned memory advised for
transparent huge pages (a product difference, not a bench setting; `--states torch` gives hf_zero's arm torch.zeros
states instead, to see the kernel alone). Parameters and gradients are plain torch tensors of the same sizes in both.
Without DeepSpeed importable the hf_zero rows are printed alone.

The byte floor (fp32 at one thread): `_stream_floor.c`, built here with the system C compiler, moves the same 28
bytes per parameter as an Adam step in one prefetched pass with almost no arithmetic (on states from the same
allocator as hf_zero's arm). It steps in the same round-robin as the two optimizers, and each is printed as a
multiple of it ("x floor"): how far each kernel is from what one core's memory allows. Skipped without a compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("fp32", "bf16", "out16", "out16v")
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _deepspeed_adam():
    """DeepSpeed's own DeepSpeedCPUAdam class, or None (not installed, or hf_zero's compatibility shim)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 -- any import failure just means "no DeepSpeed to compare with"
        return None
    if not DeepSpeedCPUAdam.__module__.startswith("deepspeed."):
        return None  # the shim's stand-in: set HF_ZERO_DISABLE_DEEPSPEED_SHIM=1
    return DeepSpeedCPUAdam


def _isa() -> str:
    sys.path.insert(0, str(REPO))
    import torch

    import hf_zero.ops.adam  # noqa: F401 -- loads hf_zero._C

    return torch.ops.hf_zero.adam_cpu_isa() if hasattr(torch.ops.hf_zero, "adam_cpu_isa") else "(before adam_cpu_isa)"


def _build_floor(out_dir: str) -> str:
    """The floor pass as a shared library, or "" (no C compiler, or it failed: the bench goes on without it)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return ""
    lib = os.path.join(out_dir, "stream_floor.so")
    done = subprocess.run([cc, "-O3", "-shared", "-fPIC", "-o", lib, str(Path(__file__).with_name("_stream_floor.c"))],
                          capture_output=True, text=True)
    return lib if done.returncode == 0 else ""


def _floor_fn(lib_path: str, numel: int, zeros):
    """A callable running the floor pass on arrays of its own (p, g: torch tensors; states: ``zeros``)."""
    import torch

    lib = ctypes.CDLL(lib_path)
    lib.stream_floor.restype = ctypes.c_int
    lib.stream_floor.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_size_t]
    p, g, m, v = torch.randn(numel), torch.randn(numel), zeros((numel,)), zeros((numel,))
    ptrs = [t.data_ptr() for t in (p, g, m, v)]

    def floor(ptrs=ptrs, keep=(p, g, m, v)):
        lib.stream_floor(*ptrs, numel)

    return floor


def _child(numel: int, threads: int, repeat: int, cases: list[str], isa: str, states: str,
           floor_lib: str = "") -> dict:
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(threads)
    from hf_zero.ops.adam import adam_step_, zeros_state

    if isa:
        torch.ops.hf_zero.adam_cpu_isa(isa)

    ds_cls = _deepspeed_adam()
    results = {}
    for case in cases:
        torch.manual_seed(0)
        fns = {}
        p = torch.randn(numel) if case != "bf16" else torch.randn(numel).bfloat16()
        g = torch.randn(numel) if case == "fp32" else torch.randn(numel).bfloat16()
        zeros = zeros_state if states == "hf_zero" else torch.zeros
        m, v = zeros((numel,)), zeros((numel,))
        out16 = torch.empty(numel, dtype=torch.bfloat16) if case.startswith("out16") else None
        step = [0]

        def ours(p=p, g=g, m=m, v=v, out16=out16, step=step):
            step[0] += 1
            adam_step_(p, g, m, v, step=step[0], adamw_mode=True, bias_correction=True, out16=out16, **HYPER)

        fns["hf_zero"] = ours
        if case == "fp32" and threads == 1 and floor_lib:
            fns["floor"] = _floor_fn(floor_lib, numel, zeros)
        if ds_cls is not None:
            dtype = torch.bfloat16 if case in ("bf16", "out16v") else torch.float32
            dp = torch.nn.Parameter(torch.randn(numel).to(dtype))
            dp.grad = torch.randn(numel).to(dtype)
            opt = ds_cls([dp], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                         weight_decay=HYPER["weight_decay"], adamw_mode=True)
            if case == "out16":
                copy16 = torch.empty(numel, dtype=torch.bfloat16)

                def theirs(opt=opt, dp=dp, copy16=copy16):
                    opt.step()
                    copy16.copy_(dp.data)

                fns["deepspeed"] = theirs
            else:
                fns["deepspeed"] = opt.step
        for fn in fns.values():  # warm-up: first-touch page faults, DeepSpeed's state allocation
            fn()
            fn()
        samples: dict[str, list[float]] = {k: [] for k in fns}
        order = list(fns)
        for r in range(repeat):
            for name in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                fns[name]()
                samples[name].append(time.perf_counter() - t0)
        results[case] = {k: statistics.median(s) for k, s in samples.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mparams", type=float, default=16.0, help="parameters in millions (default 16)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts (default 1 2)")
    parser.add_argument("--repeat", type=int, default=40, help="timed steps per optimizer and case")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--isa", default="", choices=["", "avx512", "avx2", "scalar"],
                        help="hf_zero's CPU Adam path (default: the widest this CPU has)")
    parser.add_argument("--states", default="hf_zero", choices=["hf_zero", "torch"],
                        help="hf_zero's optimizer states: from zeros_state, as CPUAdam allocates them (default), or "
                             "torch.zeros")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--floor-lib", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    numel = int(args.mparams * 1e6)
    if args.child:
        print("RESULT " + json.dumps(_child(numel, args.threads[0], args.repeat, args.cases, args.isa,
                                            args.states, args.floor_lib)))
        return

    build_dir = tempfile.mkdtemp(prefix="hf_zero_floor_")
    floor_lib = _build_floor(build_dir) if "fp32" in args.cases and 1 in args.threads else ""

    has_ds = _deepspeed_adam() is not None
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"] * 3
    print(f"CPU Adam, {numel / 1e6:.1f} M params, {args.repeat} interleaved steps each, medians; "
          f"{os.cpu_count()} CPUs, load average {' '.join(load)} (start)")
    if not has_ds:
        print("DeepSpeed not importable (or its shim active): hf_zero alone. Run with DeepSpeed's interpreter and "
              "HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 DS_ACCELERATOR=cpu to compare.")
    print(f"hf_zero CPU Adam path: {args.isa or _isa()}; hf_zero's states: {args.states}; byte floor: "
          f"{'built' if floor_lib else 'not built (no C compiler)'}")
    print(f"{'case':<7}{'threads':>8}{'hf_zero ms':>12}{'Mparam/s':>10}{'DeepSpeed ms':>14}{'Mparam/s':>10}"
          f"{'speed-up':>10}{'floor ms':>10}{'hf_zero x floor':>17}{'DeepSpeed x floor':>19}")
    for threads in args.threads:
        # Passive waiting: two OpenMP runtimes share the process, and spinning idle threads of one would steal
        # the cores from the other between steps (microseconds of wake-up against steps of milliseconds).
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE",
               "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--mparams", str(args.mparams),
               "--threads", str(threads), "--repeat", str(args.repeat), "--cases", *args.cases, "--isa", args.isa,
               "--states", args.states, "--floor-lib", floor_lib]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp", timeout=3600)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            sys.exit(f"child for {threads} threads failed:\n{out.stderr[-4000:]}")
        for case, t in json.loads(lines[-1][len("RESULT "):]).items():
            ours = t["hf_zero"]
            row = f"{case:<7}{threads:>8}{ours * 1e3:>12.2f}{numel / ours / 1e6:>10.0f}"
            if "deepspeed" in t:
                ds = t["deepspeed"]
                row += f"{ds * 1e3:>14.2f}{numel / ds / 1e6:>10.0f}{ds / ours:>9.2f}x"
            if "floor" in t:
                fl = t["floor"]
                row += "" if "deepspeed" in t else " " * 34
                row += f"{fl * 1e3:>10.2f}{ours / fl:>16.2f}x"
                if "deepspeed" in t:
                    row += f"{t['deepspeed'] / fl:>18.2f}x"
            print(row, flush=True)
    shutil.rmtree(build_dir, ignore_errors=True)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"] * 3
    print(f"load average {' '.join(load)} (end); target: speed-up >= 1.15x in every row")


if __name__ == "__main__":
    main()
