"""The launcher (``deepspeed`` / ``hf-zero launch`` / ``python -m deepspeed.launcher.runner``) and the script side
of DeepSpeed's command line (``add_config_arguments``, ``initialize(args=...)``).

Launches run the user's way: a throw-away virtual environment where ``import deepspeed`` reaches hf_zero through
the start-up ``.pth`` line, and console scripts written from pyproject.toml's ``[project.scripts]`` as pip writes
them. The training script is a DeepSpeed tutorial's shape: ``--local_rank`` from the launcher,
``deepspeed.add_config_arguments``, ``deepspeed.initialize(args=args, ...)``. Its losses (stage 2, 2 CPU ranks,
each half of the batch) must equal a single-process torch Adam on the whole batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest
import torch

from _hf_env import REPO, clean_env, make_venv
from hf_zero.config.errors import ConfigError
from hf_zero.launcher import parse_args
from hf_zero.launcher.hosts import LaunchError, filter_resources, parse_core_list, read_hostfile
from hf_zero.launcher.plan import make_plan
from hf_zero.testing import free_port

STEPS = 3
LR = 0.05
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
          "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0}}}

TRAIN = textwrap.dedent("""
    import argparse, json, os, sys
    import torch
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ckpt", default=None)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    local_rank_arg = args.local_rank
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    rank, world = engine.global_rank, engine.world_size
    per = 8 // world
    losses = []
    for _ in range(args.steps):
        loss = torch.nn.functional.mse_loss(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    resumed = None
    if args.ckpt:  # save; a fresh engine loads it; both take the same next step
        engine.save_checkpoint(args.ckpt)
        torch.manual_seed(5)
        model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        engine2, _, _, _ = deepspeed.initialize(args=args, model=model2, model_parameters=model2.parameters())
        engine2.load_checkpoint(args.ckpt)
        resumed = []
        for e in (engine, engine2):
            loss = torch.nn.functional.mse_loss(e(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
            e.backward(loss)
            e.step()
            resumed.append(loss.item())
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK",
                                          "CROSS_SIZE", "OMP_NUM_THREADS")}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"local_rank_arg": local_rank_arg, "args_local_rank": args.local_rank,
                   "engine_local_rank": engine.local_rank, "deepspeed_flag": args.deepspeed or args.deepscale,
                   "world": world, "env": env, "losses": losses, "cores": sorted(os.sched_getaffinity(0)),
                   "resumed": resumed}, f)
    # as torch's docs ask: a gloo group left to the interpreter's exit can abort the process ("terminate called
    # without an active exception", pytorch/pytorch#190489) -- seen here as a launcher exit code of 250 (-6)
    torch.distributed.destroy_process_group()
""")


def _reference_losses() -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv with hf_zero 'installed' from this checkout, plus its console scripts as pip would write them."""
    python = make_venv(tmp_path_factory.mktemp("launch_venv"))
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, func = target.split(":")
        path = python.parent / name
        path.write_text(f"#!{python}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
        path.chmod(0o755)
    return python


@pytest.fixture()
def job(tmp_path) -> Path:
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "ds_config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "out").mkdir()
    return tmp_path


def _launch(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def _results(out: Path, world: int) -> list[dict]:
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["world"] == world for r in results)
    return results


def _assert_trained_like_reference(results: list[dict]) -> None:
    reference = _reference_losses()
    for r in results:
        assert r["losses"] == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert reference[-1] < reference[0]


# ---- launches ---------------------------------------------------------------------------------------------------

def test_deepspeed_command_trains_on_two_ranks(venv, job):
    port = free_port()
    result = _launch([venv.parent / "deepspeed", "--num_gpus", "2", "--master_port", port, "train.py",
                      "--deepspeed", "--deepspeed_config", "ds_config.json", "--out", "out"], job)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    results = _results(job / "out", 2)
    _assert_trained_like_reference(results)
    for local_rank, r in enumerate(results):
        # --local_rank=N reaches the script as DeepSpeed passes it; engine.local_rank and env agree
        assert r["local_rank_arg"] == r["args_local_rank"] == r["engine_local_rank"] == local_rank
        assert r["deepspeed_flag"] is True
        assert r["env"] == {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "2",
                            "LOCAL_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1", "OMP_NUM_THREADS": "1"}


def test_hf_zero_launch_binds_each_rank_to_its_own_cores(venv, job):
    cores = sorted(__import__("os").sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 usable CPU cores to give each of 2 ranks its own")
    result = _launch([venv.parent / "hf-zero", "launch", "--num_gpus", "2", "--bind_cores_to_rank",
                      "--bind_core_list", f"{cores[0]},{cores[1]}", "--master_port", free_port(), "train.py",
                      "--deepspeed", "--deepspeed_config", "ds_config.json", "--out", "out"], job)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    results = _results(job / "out", 2)
    _assert_trained_like_reference(results)
    assert [r["cores"] for r in results] == [[cores[0]], [cores[1]]]
    assert [r["env"]["OMP_NUM_THREADS"] for r in results] == ["1", "1"]


def test_runner_module_with_deprecated_deepscale_flags(venv, job):
    """``python -m deepspeed.launcher.runner`` launches (it used to print nothing and exit 0); the deprecated
    --deepscale/--deepscale_config flags are read as DeepSpeed reads them."""
    result = _launch([venv, "-m", "deepspeed.launcher.runner", "--master_port", free_port(), "train.py",
                      "--deepscale", "--deepscale_config", "ds_config.json", "--out", "out", "--steps", "1"], job)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (r,) = _results(job / "out", 1)
    assert r["local_rank_arg"] == 0 and r["deepspeed_flag"] is True and len(r["losses"]) == 1
    assert "--deepscale_config is deprecated" in result.stdout + result.stderr


def test_two_node_launch_on_localhost(venv, job):
    """Two launcher processes, one per 'node', meeting at node 0's rendezvous: one rank each, trains as one world.
    Node 0 is described by a hostfile, node 1 by explicit --num_nodes/--num_gpus/--master_addr: both ways name the
    same two-node world. Each node runs in its own directory and checkpoints to ``ckpt`` there -- node-local disks,
    with checkpoint.use_node_local_storage; a fresh engine on each node loads its node's copy and steps like the
    saved one."""
    port = free_port()
    config = {**CONFIG, "checkpoint": {"use_node_local_storage": True}}
    for node in (0, 1):
        (job / f"node{node}").mkdir()
        (job / f"node{node}" / "train.py").write_text(TRAIN)
        (job / f"node{node}" / "ds_config.json").write_text(json.dumps(config))
    (job / "node0" / "hostfile").write_text("# two nodes that happen to be this machine\n127.0.0.1 slots=1\n"
                                            "localhost slots=1\n")
    node_flags = [["--hostfile", "hostfile"],
                  ["--hostfile", "no-such-hostfile", "--num_nodes", "2", "--num_gpus", "1", "--master_addr",
                   "127.0.0.1"]]
    # each node's output into a file of its own, not a pipe: waiting on node 0 while nobody reads node 1's pipe
    # would stall node 1 on a full pipe (64 KiB) -- and node 0 with it, in their next collective
    logs = [job / f"node{node}.log" for node in (0, 1)]
    procs = []
    for node in (0, 1):
        with open(logs[node], "w") as log:
            procs.append(subprocess.Popen(
                [str(venv.parent / "hf-zero"), "launch", *node_flags[node], "--node_rank", str(node), "--master_port",
                 str(port), "train.py", "--deepspeed", "--deepspeed_config", "ds_config.json", "--out",
                 str(job / "out"), "--ckpt", "ckpt"], cwd=job / f"node{node}", env=clean_env(), stdout=log,
                stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + 300
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(o[-3000:] for o in outputs)
    results = _results(job / "out", 2)
    _assert_trained_like_reference(results)
    for node, r in enumerate(results):
        assert r["local_rank_arg"] == 0
        assert (r["env"]["RANK"], r["env"]["CROSS_RANK"], r["env"]["CROSS_SIZE"]) == (str(node), str(node), "2")
        saved, loaded = r["resumed"]
        assert loaded == pytest.approx(saved, rel=0, abs=1e-6)
        ckpt = job / f"node{node}" / "ckpt"
        assert (ckpt / "latest").read_text() == f"global_step{STEPS}"
        assert sorted(os.listdir(ckpt / f"global_step{STEPS}")) == [  # the node's own shards, its own model copy
            "engine_state.pt", "manifest.json", "meta.json", "model.safetensors", f"zero_rank{node:05d}.safetensors"]


def test_failing_rank_exit_code_is_the_launchers(venv, tmp_path):
    (tmp_path / "fail.py").write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    result = _launch([venv.parent / "deepspeed", "--num_gpus", "2", "--master_port", free_port(), "--no_local_rank",
                      "fail.py"], tmp_path, timeout=120)
    assert result.returncode == 3, result.stderr[-3000:]


def test_exit_code_is_the_failing_ranks_not_a_rank_the_agent_stopped():
    """The race behind a red CI run: rank 1 exits 3, rank 0 is still alive and the agent SIGTERMs it; the failures
    then hold rank 0's -15 too, which once made the launcher exit 241."""
    from types import SimpleNamespace as F

    from hf_zero.launcher.run import _root_exit_code

    assert _root_exit_code({0: F(exitcode=-15, timestamp=11), 1: F(exitcode=3, timestamp=10)}) == 3
    assert _root_exit_code({0: F(exitcode=-15, timestamp=10), 1: F(exitcode=3, timestamp=10)}) == 3
    assert _root_exit_code({0: F(exitcode=2, timestamp=12), 1: F(exitcode=5, timestamp=10)}) == 5  # the first
    assert _root_exit_code({0: F(exitcode=-9, timestamp=10)}) == 137  # killed: the shell's 128 + signal
    assert _root_exit_code({0: F(exitcode=-11, timestamp=10), 1: F(exitcode=-15, timestamp=10)}) == 139


def test_deepspeed_command_runs_a_real_deepspeeds_launcher(venv, tmp_path):
    """With a real DeepSpeed importable, the ``deepspeed`` command hf-zero installs runs DeepSpeed's runner."""
    fake = tmp_path / "site" / "deepspeed"
    (fake / "launcher").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launcher" / "__init__.py").write_text("")
    (fake / "launcher" / "runner.py").write_text(
        "import sys\ndef main(args=None):\n    print('REAL DEEPSPEED RUNNER', sys.argv[1:])\n    return 7\n")
    env = clean_env(PYTHONPATH=str(tmp_path / "site"))
    result = subprocess.run([str(venv.parent / "deepspeed"), "--num_gpus", "2", "x.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 7, result.stderr
    assert "REAL DEEPSPEED RUNNER ['--num_gpus', '2', 'x.py']" in result.stdout


def test_ds_report_is_hf_zeros_doctor_or_a_real_deepspeeds_report(venv, tmp_path):
    """``ds_report`` (what DeepSpeed's issue template asks for): hf_zero's doctor without DeepSpeed; a real
    DeepSpeed's ``env_report.cli_main`` when one is importable."""
    result = subprocess.run([str(venv.parent / "ds_report")], cwd=tmp_path, env=clean_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hf_zero doctor") and "Compiled ops" in result.stdout
    fake = tmp_path / "site" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "env_report.py").write_text("def cli_main():\n    print('REAL DEEPSPEED REPORT')\n")
    result = subprocess.run([str(venv.parent / "ds_report")], cwd=tmp_path,
                            env=clean_env(PYTHONPATH=str(tmp_path / "site")), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "REAL DEEPSPEED REPORT", result.stderr


def test_launch_error_names_the_flag(venv, tmp_path):
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    result = _launch([venv.parent / "hf-zero", "launch", "--hostfile", "hosts", "train.py"], tmp_path, timeout=60)
    assert result.returncode == 2
    assert "--node_rank" in result.stderr and "node-a, node-b" in result.stderr


def test_runner_main_called_from_python_raises_as_deepspeeds():
    """``deepspeed.launcher.runner.main(args=[...])`` from a script: flags that cannot go together raise a
    ValueError before anything starts (DeepSpeed's test_run.test_num_plus_parser), where the commands print."""
    from deepspeed.launcher.runner import main as runner_main

    for argv in ("--num_nodes 1 -i localhost foo.py", "--num_gpus 1 -e localhost foo.py"):
        with pytest.raises(ValueError, match="--include/--exclude cannot be combined with --num_nodes/--num_gpus"):
            runner_main(args=argv.split())


# ---- planning (no processes) ------------------------------------------------------------------------------------

def _plan(argv: list[str], device_count: int = 0):
    return make_plan(parse_args([*argv, "train.py"]), device_count)


def test_hostfile_parsing(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("worker-0 slots=4  # first\n\n# comment\nworker-1 slots=2\n")
    assert read_hostfile(str(path)) == {"worker-0": 4, "worker-1": 2}
    assert read_hostfile(str(tmp_path / "missing")) is None
    path.write_text("worker-0 slots=4\nworker-0 slots=2\n")
    with pytest.raises(LaunchError, match="listed twice"):
        read_hostfile(str(path))
    path.write_text("worker-0 gpus=4\n")
    with pytest.raises(LaunchError, match="line 1"):
        read_hostfile(str(path))


def test_include_exclude_filters():
    resources = {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    assert filter_resources(resources, include="a:1,3") == {"a": [1, 3]}
    assert filter_resources(resources, include="a@b:0") == {"a": [0, 1, 2, 3], "b": [0]}
    assert filter_resources(resources, exclude="a") == {"b": [0, 1, 2, 3]}
    assert filter_resources(resources, exclude="b:0,1") == {"a": [0, 1, 2, 3], "b": [2, 3]}
    with pytest.raises(LaunchError, match="mutually exclusive"):
        filter_resources(resources, include="a", exclude="b")
    with pytest.raises(LaunchError, match="host 'c'"):
        filter_resources(resources, include="c")
    with pytest.raises(LaunchError, match=r"no slot\(s\) \[7\]"):
        filter_resources(resources, exclude="a:7")


def test_plans(tmp_path):
    plan = _plan(["--num_gpus", "3"])
    assert (plan.nnodes, plan.node_rank, plan.nproc, plan.master_addr, plan.master_port) == (1, 0, 3, "127.0.0.1",
                                                                                           29500)
    assert _plan([], device_count=0).nproc == 1 and _plan([], device_count=4).nproc == 4
    assert _plan(["--include", "localhost:1,3"], device_count=4).slots == (1, 3)
    hosts = tmp_path / "hosts"
    hosts.write_text("n0 slots=4\nn1 slots=2\nn2 slots=4\n")
    plan = _plan(["--hostfile", str(hosts), "--node_rank", "1"])
    assert (plan.nnodes, plan.node_rank, plan.nproc, plan.master_addr) == (3, 1, 2, "n0")
    plan = _plan(["--hostfile", str(hosts), "--num_nodes", "2", "--num_gpus", "1", "--node_rank", "0",
                  "--master_addr", "10.0.0.1"])
    assert (plan.nnodes, plan.nproc, plan.master_addr) == (2, 1, "10.0.0.1")
    assert _plan(["--hostfile", str(hosts), "--exclude", "n1", "--node_rank", "1"]).slots == (0, 1, 2, 3)
    with pytest.raises(LaunchError, match="cannot be combined"):
        _plan(["--hostfile", str(hosts), "--include", "n0", "--num_gpus", "1"])
    with pytest.raises(LaunchError, match="--node_rank 5"):
        _plan(["--hostfile", str(hosts), "--node_rank", "5"])
    with pytest.raises(LaunchError, match="fewer slots"):
        _plan(["--hostfile", str(hosts), "--num_gpus", "3", "--node_rank", "0"])
    with pytest.raises(LaunchError, match="--master_addr"):
        _plan(["--hostfile", str(tmp_path / "none"), "--num_nodes", "2", "--node_rank", "0"])
    with pytest.raises(LaunchError, match="--autotuning, --save_pid"):
        _plan(["--autotuning", "tune", "--save_pid"])


def test_core_binding_plan():
    assert parse_core_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    plan = _plan(["--num_gpus", "2", "--bind_cores_to_rank", "--bind_core_list", "0-4"])
    assert plan.cores_per_rank == ((0, 1), (2, 3))  # equal shares; the odd core is left out, as DeepSpeed does
    with pytest.raises(LaunchError, match="its own core"):
        _plan(["--num_gpus", "3", "--bind_cores_to_rank", "--bind_core_list", "0-1"])
    with pytest.raises(LaunchError, match="twice"):
        parse_core_list("0-2,1")


# ---- the script side --------------------------------------------------------------------------------------------

def test_add_config_arguments_flags_and_defaults():
    import hf_zero

    parser = hf_zero.add_config_arguments(argparse.ArgumentParser())
    defaults = parser.parse_args([])
    assert (defaults.deepspeed, defaults.deepspeed_config, defaults.deepscale, defaults.deepscale_config) == \
        (False, None, False, None)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "c.json"])
    assert args.deepspeed is True and args.deepspeed_config == "c.json"


def _tiny():
    return torch.nn.Linear(4, 2)


def test_initialize_reads_args_and_refuses_two_configs(tmp_path, monkeypatch):
    import hf_zero

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "c.json"
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    path.write_text(json.dumps(config))
    parser = hf_zero.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    with pytest.raises(ConfigError, match="args.deepspeed_config"):
        hf_zero.initialize(args=args, model=_tiny(), config=config)
    both = parser.parse_args(["--deepspeed_config", str(path), "--deepscale_config", str(path)])
    with pytest.raises(ConfigError, match="--deepscale_config"):
        hf_zero.initialize(args=both, model=_tiny())
    monkeypatch.setenv("LOCAL_RANK", "0")
    engine, optimizer, _, _ = hf_zero.initialize(args=args, model=_tiny())
    assert engine.get_lr() == [0.5]  # the args' config file is the one used
    assert args.local_rank == 0 == engine.local_rank  # aligned with LOCAL_RANK, as DeepSpeed does


def test_pyproject_declares_both_commands():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["deepspeed"] == "hf_zero.integrations.deepspeed_command:main"
    assert scripts["hf-zero"] == "hf_zero.cli:main"


def test_doctor_says_which_deepspeed_command_runs(venv, tmp_path):
    import os

    env = clean_env(PATH=f"{venv.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run([str(venv), "-m", "hf_zero", "doctor"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"deepspeed command  {venv.parent / 'deepspeed'}: hf-zero's" in out.stdout
