"""Runs a peer's own DeepSpeed tests on hf_zero and on DeepSpeed, and compares them (docs/peer_suites.md).

    scripts/peer_suites.sh PEER_CHECKOUT [--ds-python /path/to/python-with-deepspeed] [options] [-- pytest args]

The peer's test files are run unedited from its checkout against the installed peer package. Three things
change around them: the hardware gates are lifted (peer_gates.py, a pytest plugin), the Hub names they load
resolve to tiny local models (hub.py, through the offline Hub cache), and tests that launch distributed jobs
get 2 CPU processes. Each engine runs in its own pytest process, one after the other.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hub  # noqa: E402

__all__ = ["SUITES", "Suite", "main", "parse_junit", "root_cause", "compare"]


@dataclass(frozen=True)
class Suite:
    package: str  # the installed distribution the tests exercise
    paths: tuple[str, ...]  # test paths inside the checkout; the ones present are run
    pytest_args: tuple[str, ...] = ()


SUITES: dict[str, Suite] = {
    "accelerate": Suite("accelerate", ("tests/deepspeed",)),
    "transformers": Suite(
        "transformers", ("tests/deepspeed", "tests/trainer/distributed/test_trainer_distributed_deepspeed.py")
    ),
    # peft's DeepSpeed tests sit among others; -k is case-insensitive
    "peft": Suite(
        "peft", ("tests/test_gpu_examples.py", "tests/test_initialization.py", "tests/test_low_level_api.py"),
        ("-k", "deepspeed or zero3"),
    ),
}

# Engines: name -> environment that selects it. hf_zero answers ``import deepspeed`` where DeepSpeed is absent;
# with DeepSpeed installed, its own switch turns the shim off and DeepSpeed runs on the CPU accelerator.
ENGINE_ENV = {
    "hf_zero": {},
    "deepspeed": {"HF_ZERO_DISABLE_DEEPSPEED_SHIM": "1", "DS_ACCELERATOR": "cpu"},
}


def detect_suite(checkout: str) -> str:
    for name in SUITES:
        if os.path.isdir(os.path.join(checkout, "src", name)):
            return name
    raise SystemExit(f"{checkout}: no src/accelerate, src/transformers or src/peft; pass --suite")


def checkout_version(checkout: str, package: str) -> str | None:
    path = os.path.join(checkout, "src", package, "__init__.py")
    if not os.path.exists(path):
        return None
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)', open(path, encoding="utf-8").read(), re.M)
    return match.group(1) if match else None


def _write_bin(bin_dir: str, python: str) -> None:
    """``accelerate``, ``torchrun`` and ``python`` on PATH run the engine's interpreter (the tests spawn them
    by name)."""
    os.makedirs(bin_dir, exist_ok=True)
    commands = {
        "accelerate": f'exec {shlex.quote(python)} -m accelerate.commands.accelerate_cli "$@"',
        "torchrun": f'exec {shlex.quote(python)} -m torch.distributed.run "$@"',
        "python": f'exec {shlex.quote(python)} "$@"',
        "python3": f'exec {shlex.quote(python)} "$@"',
    }
    for name, line in commands.items():
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\n{line}\n")
        os.chmod(path, 0o755)


def _has_module(python: str, module: str, env: dict[str, str]) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], env=env, capture_output=True).returncode == 0


def engine_env(engine: str, python: str, work: str, hub_vars: dict[str, str], nproc: int, slow: bool,
               peer_src: str | None = None) -> dict:
    env = dict(os.environ)
    env.update(hub_vars)
    env.update(ENGINE_ENV[engine])
    bin_dir = os.path.join(work, f"bin-{engine}")
    _write_bin(bin_dir, python)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    python_path = [HERE] + ([peer_src] if peer_src else [])
    if not _has_module(python, "evaluate", env):
        python_path.append(os.path.join(HERE, "standins"))
    env["PYTHONPATH"] = os.pathsep.join(python_path + [p for p in [env.get("PYTHONPATH")] if p])
    env["PEER_SUITES_NPROC"] = str(nproc)
    if slow:
        env["RUN_SLOW"] = "1"
    return env


def write_accelerate_config(hf_home: str, nproc: int) -> str:
    """accelerate's default config (read from HF_HOME) for the tests that run ``accelerate launch
    --num_processes=2 script.py`` with no launcher flag: on a machine with 2 GPUs accelerate picks its multi-GPU
    launcher (torchrun, one process per rank); on a CPU-only machine it runs one process with no RANK. This config
    makes it pick torchrun here too; the processes see no GPU and run on CPU (gloo). Flags on the command line
    (``--use_deepspeed``, ``--num_processes``, ``--mixed_precision``) still win."""
    path = os.path.join(hf_home, "accelerate", "default_config.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\n"
                f"num_processes: {nproc}\nmachine_rank: 0\ngpu_ids: all\nuse_cpu: false\ndebug: false\n")
    return path


@dataclass
class Result:
    outcome: str  # "passed" | "failed" | "skipped"
    message: str = ""


@dataclass
class Run:
    engine: str
    results: dict[str, Result] = field(default_factory=dict)
    wall_s: float = 0.0

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.results.values())


def parse_junit(path: str) -> dict[str, Result]:
    """test id (``module.Class::test``) -> outcome and failure text, from pytest's --junitxml file."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        captured = ""
        for child in case:
            if child.tag in ("failure", "error") and outcome != "failed":
                outcome = "failed"
                message = f"{child.get('message') or ''}\n{child.text or ''}"
            elif child.tag == "skipped" and outcome == "passed":
                outcome, message = "skipped", child.get("message") or ""
            elif child.tag in ("system-out", "system-err"):
                captured += f"\n{child.text or ''}"
        # a launched job's own traceback is in what the test captured (its stderr), after pytest's report
        results[test_id] = Result(outcome, message + captured if outcome == "failed" else message)
    return results


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)|Failed)(: .*)?$")
_PREFIX = re.compile(r"^(E\s+|\[rank\d+\]:\s*|\[default\d+\]:\s*|\s+)+")
# Lines that only say a child process failed; the cause is the child's own exception.
_WRAPPERS = re.compile(r"returncode|ChildFailedError|CalledProcessError|failed with|SignalException|Timeout >")


def root_cause(text: str) -> str:
    """The first exception line that ends its chain (not followed by "During handling of the above exception")
    and is not a launcher's "a child failed" wrapper: the child's own error when a test launched processes.
    Else the first exception line, else the first non-empty line."""
    lines = [_PREFIX.sub("", line).rstrip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    found, final = [], []
    for i, line in enumerate(lines):
        if _EXCEPTION_LINE.match(line):
            found.append(line)
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if not following.startswith(("During handling of the above exception", "The above exception was")):
                final.append(line)
    own = [line for line in final if not _WRAPPERS.search(line)]
    for candidates in (own, found, lines):
        if candidates:
            return candidates[0][:400]
    return ""


def compare(hf_zero: Run, deepspeed: Run) -> tuple[list[str], list[str]]:
    """(DeepSpeed passes and hf_zero fails, hf_zero passes and DeepSpeed fails)"""
    ds_only = sorted(t for t, r in deepspeed.results.items() if r.outcome == "passed"
                     and hf_zero.results.get(t, Result("missing")).outcome == "failed")
    hf_only = sorted(t for t, r in hf_zero.results.items() if r.outcome == "passed"
                     and deepspeed.results.get(t, Result("missing")).outcome == "failed")
    return ds_only, hf_only


def run_engine(engine, python, checkout, suite, work, hub_vars, args) -> Run:
    peer_src = os.path.join(checkout, "src") if args.peer_src else None
    env = engine_env(engine, python, work, hub_vars, args.nproc, not args.no_slow, peer_src)
    xml_path = os.path.join(work, f"{engine}.xml")
    log_path = os.path.join(work, f"{engine}.log")
    paths = [p for p in (args.paths or suite.paths) if os.path.exists(os.path.join(checkout, p))]
    # addopts cleared (peft's adds coverage); junit_logging keeps a launched job's stderr for root_cause
    cmd = [python, "-m", "pytest", *paths, "-p", "peer_gates", "-p", "no:cacheprovider", "-o", "addopts=",
           "-o", "junit_logging=all", f"--timeout={args.timeout}", "-rfEs", "-v", f"--junitxml={xml_path}",
           *suite.pytest_args, *args.pytest_args]
    print(f"[{engine}] {' '.join(shlex.quote(c) for c in cmd)}\n[{engine}] log: {log_path}", flush=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        subprocess.run(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    run = Run(engine, parse_junit(xml_path) if os.path.exists(xml_path) else {}, time.monotonic() - start)
    print(f"[{engine}] {run.count('passed')} passed, {run.count('failed')} failed, {run.count('skipped')} skipped "
          f"in {run.wall_s:.0f} s", flush=True)
    return run


def report(runs: dict[str, Run], out=sys.stdout) -> dict:
    print("\nengine       passed  failed  skipped  runnable  total", file=out)
    for run in runs.values():
        total = len(run.results)
        print(f"{run.engine:<12} {run.count('passed'):>6}  {run.count('failed'):>6}  {run.count('skipped'):>7}  "
              f"{total - run.count('skipped'):>8}  {total:>5}", file=out)
    summary = {e: {o: r.count(o) for o in ("passed", "failed", "skipped")} for e, r in runs.items()}
    if "hf_zero" in runs and "deepspeed" in runs:
        ds_only, hf_only = compare(runs["hf_zero"], runs["deepspeed"])
        print(f"\nDeepSpeed passes, hf_zero fails ({len(ds_only)}):", file=out)
        for test_id in ds_only:
            print(f"  {test_id}\n      {root_cause(runs['hf_zero'].results[test_id].message)}", file=out)
        print(f"\nhf_zero passes, DeepSpeed fails ({len(hf_only)}):", file=out)
        for test_id in hf_only:
            print(f"  {test_id}\n      {root_cause(runs['deepspeed'].results[test_id].message)}", file=out)
        summary["deepspeed_pass_hf_zero_fail"] = ds_only
        summary["hf_zero_pass_deepspeed_fail"] = hf_only
    for run in runs.values():
        failed = sorted(t for t, r in run.results.items() if r.outcome == "failed")
        print(f"\n{run.engine} failures ({len(failed)}):", file=out)
        for test_id in failed:
            print(f"  {test_id}\n      {root_cause(run.results[test_id].message)}", file=out)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/peer_suites.sh", description=__doc__.split("\n\n")[0], epilog="-- PYTEST_ARGS: passed to pytest"
    )
    parser.add_argument("checkout", help="a checkout of the peer's repository at the installed version")
    parser.add_argument("--suite", choices=sorted(SUITES), help="default: detected from the checkout's src/")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with hf_zero (default: this one)")
    parser.add_argument("--ds-python", help="an interpreter with DeepSpeed installed; without it only hf_zero runs")
    parser.add_argument("--engines", default="hf_zero,deepspeed", help="which to run, in order (default: both)")
    parser.add_argument("--work", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "build", "peer_suites"),
                        help="stand-in models, logs and junit files (default: build/peer_suites)")
    parser.add_argument("--timeout", type=int, default=900, help="per-test timeout in seconds (default 900)")
    parser.add_argument("--nproc", type=int, default=2, help="CPU processes for the distributed tests (default 2)")
    parser.add_argument("--no-slow", action="store_true", help="leave RUN_SLOW unset (the peers' slow tests skip)")
    parser.add_argument("--peer-src", action="store_true",
                        help="import the peer package from the checkout's src/ (as its CI's editable install does; "
                             "scripts that read files of the source tree beside the package need it)")
    parser.add_argument("--paths", nargs="+", help="test paths inside the checkout instead of the suite's own")
    parser.add_argument("--report-only", action="store_true", help="re-read the last junit files, run nothing")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.pytest_args = argv[split + 1:]  # after --: passed to pytest (e.g. -k checkpoint)

    checkout = os.path.abspath(args.checkout)
    suite_name = args.suite or detect_suite(checkout)
    suite = SUITES[suite_name]
    work = os.path.join(os.path.abspath(args.work), suite_name)
    os.makedirs(work, exist_ok=True)
    installed = importlib.metadata.version(suite.package)
    peer = checkout_version(checkout, suite.package)
    print(f"suite {suite_name}: {', '.join(suite.paths)} from {checkout} (checkout {peer}, installed {installed})")
    if peer and peer.split(".dev")[0] != installed:
        print(f"warning: the checkout is {suite.package} {peer}, the installed package {installed}")

    pythons = {"hf_zero": args.python, "deepspeed": args.ds_python}
    engines = [e for e in args.engines.split(",") if e and (e != "deepspeed" or args.ds_python)]
    runs = {}
    if args.report_only:
        for engine in engines:
            xml_path = os.path.join(work, f"{engine}.xml")
            if os.path.exists(xml_path):
                runs[engine] = Run(engine, parse_junit(xml_path))
    else:
        hub_vars = hub.build_hub(os.path.join(os.path.dirname(work), "hub_standins"))
        write_accelerate_config(hub_vars["HF_HOME"], args.nproc)
        for engine in engines:
            runs[engine] = run_engine(engine, pythons[engine], checkout, suite, work, hub_vars, args)
    summary = report(runs)
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
