"""Launch a 2-rank training script N times and count the abnormal exits (docs/reliability.md, the exit abort).

Runs aborted after training finished ('terminate called without an active exception', a rank killed by SIGABRT):
bound-cores launcher runs (issue #25) and once the Trainer + sequence-parallel test. ``--launch launcher`` runs the
launch tests/test_launcher.py makes (``hf-zero launch --num_gpus 2 --bind_cores_to_rank``, ZeRO-2, 2 CPU ranks);
``--launch sp-trainer`` the one of test_sequence_parallel.py's Trainer test (torchrun, 2 gloo ranks,
tests/_sequence_parallel_script.py --trainer). Each runs ``--runs`` times per arm -- the shared-memory ring on
(``HF_ZERO_SHM_COMM=1``) and off (``=0``) -- and prints each run's exit code, then per arm how many exited 0. A run
that exits otherwise keeps its directory: output, and with ``--cores`` a core file per aborted rank (core dumps
enabled for the launch, PYTHONFAULTHANDLER=1 for the Python stacks) and ``gdb``'s backtrace of every thread when
gdb is installed (core_pattern must write into the working directory: ``core``).

    python scripts/launch_exits.py --runs 20                 # both arms, bound to the first two cores
    python scripts/launch_exits.py --runs 20 --arms on --no-bind
    python scripts/launch_exits.py --launch sp-trainer --runs 50 --arms off --cores

Exit status: 0 when every run exited 0, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _hf_env import clean_env, make_venv  # noqa: E402
from test_launcher import CONFIG, TRAIN  # noqa: E402

from hf_zero.comm.process_group import free_port  # noqa: E402


def _venv(root: Path) -> Path:
    python = make_venv(root / "venv")
    for name, target in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"].items():
        module, func = target.split(":")
        path = python.parent / name
        path.write_text(f"#!{python}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
        path.chmod(0o755)
    return python


def _enable_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _backtraces(job: Path, python: str) -> str:
    if shutil.which("gdb") is None:
        return "(gdb not installed)"
    out = []
    for core in sorted(job.glob("core*")):
        r = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt 30", python, str(core)],
                           capture_output=True, text=True, timeout=300)
        out.append(f"==== {core.name}\n{r.stdout[-20000:]}")
    return "\n".join(out) or "(no core file: see /proc/sys/kernel/core_pattern)"


def run_sp_trainer(python: Path, job: Path, ring: bool, dump: bool) -> tuple[int, str]:
    job.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "_sequence_parallel_script.py"), str(job / "out.json"), "--trainer"]
    env = clean_env(HF_ZERO_SHM_COMM="1" if ring else "0", PYTHONFAULTHANDLER="1", MASTER_ADDR="127.0.0.1")
    r = subprocess.run(cmd, cwd=job, env=env, capture_output=True, text=True, timeout=600,
                       preexec_fn=_enable_cores if dump else None)
    return r.returncode, r.stdout + r.stderr


def run_once(hf_zero_cmd: Path, job: Path, ring: bool, bind: bool, cores: list[int], dump: bool) -> tuple[int, str]:
    (job / "out").mkdir(parents=True, exist_ok=True)
    (job / "train.py").write_text(TRAIN)
    (job / "ds_config.json").write_text(json.dumps(CONFIG))
    cmd = [str(hf_zero_cmd), "launch", "--num_gpus", "2", "--master_port", str(free_port())]
    if bind:
        cmd += ["--bind_cores_to_rank", "--bind_core_list", f"{cores[0]},{cores[1]}"]
    cmd += ["train.py", "--deepspeed", "--deepspeed_config", "ds_config.json", "--out", "out"]
    env = clean_env(HF_ZERO_SHM_COMM="1" if ring else "0", PYTHONFAULTHANDLER="1")
    r = subprocess.run(cmd, cwd=job, env=env, capture_output=True, text=True, timeout=600,
                       preexec_fn=_enable_cores if dump else None)
    return r.returncode, r.stdout + r.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", choices=["launcher", "sp-trainer"], default="launcher",
                   help="test_launcher.py's bound-cores launch, or test_sequence_parallel.py's Trainer launch")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--arms", choices=["both", "on", "off"], default="both", help="the shared-memory ring")
    p.add_argument("--no-bind", dest="bind", action="store_false", help="leave the ranks unbound")
    p.add_argument("--cores", dest="dump", action="store_true", help="core dumps + gdb backtraces of aborts")
    p.add_argument("--keep", type=Path, default=None, help="directory for the failed runs (default: a temp dir)")
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    args.bind = args.bind and args.launch == "launcher"  # torchrun does not bind
    if args.bind and len(cores) < 2:
        print("needs 2 usable cores to bind 2 ranks")
        return 2
    root = Path(tempfile.mkdtemp(prefix="hf_zero_launch_exits_"))
    keep = args.keep or root / "failed"
    python = _venv(root)
    arms = {"both": [True, False], "on": [True], "off": [False]}[args.arms]
    counts = {}
    # interleaved, so a change of load on the machine affects both arms alike
    for i in range(args.runs):
        for ring in arms:
            job = root / f"{'ring' if ring else 'noring'}_{i}"
            start = time.monotonic()
            if args.launch == "sp-trainer":
                rc, output = run_sp_trainer(python, job, ring, args.dump)
            else:
                rc, output = run_once(python.parent / "hf-zero", job, ring, args.bind, cores, args.dump)
            aborted = "terminate called" in output
            counts.setdefault(ring, []).append(rc)
            print(f"run {i:2d} ring={'on ' if ring else 'off'} rc={rc} {time.monotonic() - start:5.1f}s"
                  + (" 'terminate called'" if aborted else ""), flush=True)
            if rc != 0 or aborted:
                dest = keep / job.name
                shutil.copytree(job, dest, dirs_exist_ok=True)
                (dest / "output.txt").write_text(output)
                if args.dump:
                    (dest / "backtraces.txt").write_text(_backtraces(job, sys.executable))
                print(f"    kept in {dest}; tail:\n" + "\n".join(output.splitlines()[-15:]), flush=True)
            shutil.rmtree(job, ignore_errors=True)
    bad = 0
    for ring, rcs in counts.items():
        ok = sum(rc == 0 for rc in rcs)
        bad += len(rcs) - ok
        print(f"ring {'on ' if ring else 'off'}: {ok}/{len(rcs)} exited 0; exit codes {sorted(set(rcs))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
