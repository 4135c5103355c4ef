"""The ``deepspeed`` compatibility layer, exercised the way users get it: through the ``.pth`` start-up line.

Every check runs in a fresh interpreter of a throw-away virtual environment (``_hf_env.make_venv``: torch,
transformers, accelerate and pip are the running interpreter's) whose site-packages holds a path entry for this checkout and a
copy of ``hf_zero/integrations/hf_zero_deepspeed.pth`` -- the same file installation copies -- so the finder is
installed by Python's own start-up code, exactly as in an installed hf_zero.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hf_zero.comm.accelerator import Accelerator, get_accelerator
from hf_zero.checkpoint.clone import clone_tensors_for_torch_save

from _hf_env import make_venv

REPO = Path(__file__).resolve().parents[1]
PTH = REPO / "hf_zero" / "integrations" / "hf_zero_deepspeed.pth"
SHIM_TREE = REPO / "hf_zero" / "integrations" / "deepspeed_shim" / "deepspeed"
DISABLE = "HF_ZERO_DISABLE_DEEPSPEED_SHIM"


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A virtual environment whose start-up installs the shim through the real .pth line; returns its python."""
    return make_venv(tmp_path_factory.mktemp("shim_venv"))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (DISABLE, "PYTHONPATH")}
    env.update(extra)
    return env


def _run(python: Path, code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", textwrap.dedent(code)], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=120)


def _json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_pth_is_one_line_that_cannot_break_startup(tmp_path):
    lines = PTH.read_text().splitlines()
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("import ")  # site.py executes only lines that start with "import"
    assert DISABLE in line
    assert "hf_zero.integrations.deepspeed_shim._finder" in line
    # A broken hf_zero (here: one whose import raises) must not break the interpreter or print anything.
    broken = tmp_path / "broken"
    (broken / "hf_zero").mkdir(parents=True)
    (broken / "hf_zero" / "__init__.py").write_text("raise RuntimeError('hf_zero is broken')\n")
    result = subprocess.run(
        [sys.executable, "-c", f"exec(open({str(PTH)!r}).read()); import importlib.util; "
                               "print(importlib.util.find_spec('deepspeed'))"],
        cwd=tmp_path, env=_env(PYTHONPATH=str(broken)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"
    assert result.stderr == ""


SHIM_CHECKS = r"""
import importlib, importlib.metadata as md, importlib.util, json, sys
out = {"torch_at_startup": "torch" in sys.modules, "hf_zero_at_startup": "hf_zero" in sys.modules}
spec = importlib.util.find_spec("deepspeed")
out["spec_origin"] = spec.origin
import deepspeed
out["file"] = deepspeed.__file__
out["__version__"] = deepspeed.__version__
out["version"] = md.version("deepspeed")
out["metadata_name"] = md.metadata("deepspeed")["Name"]
out["summary"] = md.metadata("deepspeed")["Summary"]
out["listed"] = sorted({(d.metadata["Name"] or "").lower() for d in md.distributions()} & {"deepspeed"})
out["VALID_LR_SCHEDULES"] = deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES  # the chain accelerate reads

import hf_zero.comm, hf_zero.runtime.lr_schedules, hf_zero.comm.accelerator, hf_zero.integrations.compat
import hf_zero.integrations.ds_comm
import hf_zero.checkpoint.clone, hf_zero.ops.adam
out["same_objects"] = {
    "lr_schedules": deepspeed.runtime.lr_schedules is hf_zero.runtime.lr_schedules,
    "WarmupLR": deepspeed.runtime.lr_schedules.WarmupLR is hf_zero.runtime.lr_schedules.WarmupLR,
    "comm": deepspeed.comm is hf_zero.integrations.ds_comm,
    "init_distributed": deepspeed.init_distributed is hf_zero.comm.init_distributed,
    "zero": deepspeed.zero is deepspeed.runtime.zero,
    "get_accelerator": deepspeed.accelerator.get_accelerator is hf_zero.comm.accelerator.get_accelerator,
    "logger": deepspeed.utils.logger is hf_zero.integrations.compat.logger,
    "utils.is_initialized": deepspeed.utils.is_initialized is hf_zero.comm.is_initialized,
    "clone": (importlib.import_module("deepspeed.checkpoint.utils").clone_tensors_for_torch_save
              is hf_zero.checkpoint.clone.clone_tensors_for_torch_save),
    "DeepSpeedCPUAdam": importlib.import_module("deepspeed.ops.adam").DeepSpeedCPUAdam is hf_zero.ops.adam.CPUAdam,
    "FusedAdam": importlib.import_module("deepspeed.ops.adam").FusedAdam is hf_zero.ops.adam.FusedAdam,
    # DeepSpeed's top-level exports
    "OnDevice": deepspeed.OnDevice is deepspeed.utils.OnDevice,
    "log_dist": deepspeed.log_dist is deepspeed.utils.log_dist,
    "top_logger": deepspeed.logger is deepspeed.utils.logger,
    "DeepSpeedDataLoader": deepspeed.DeepSpeedDataLoader is deepspeed.runtime.dataloader.DeepSpeedDataLoader,
    "DeepSpeedInferenceConfig": deepspeed.DeepSpeedInferenceConfig is importlib.import_module(
        "hf_zero.runtime.inference_config").DeepSpeedInferenceConfig,
    "version": deepspeed.version == deepspeed.__version__,
}
from deepspeed import comm as dist  # accelerate's state.py
out["comm_calls"] = [dist.is_initialized(), dist.get_rank(), dist.get_world_size()]
acc = deepspeed.accelerator.get_accelerator()
out["accelerator"] = [acc.device_name(0), acc.current_device_name(), acc.is_available(),
                      acc.communication_backend_name()]
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
out["env_name"] = DEEPSPEED_ENVIRONMENT_NAME
try:
    deepspeed.no_such_name
except AttributeError as e:
    out["unknown_attr"] = str(e)

# Names whose hf_zero targets other engineers are writing: each must be the target itself, or fail naming it.
pending = {}
for shim_mod, name, target_mod, target_name in [
    ("deepspeed", "initialize", "hf_zero.integrations.compat", "initialize"),  # wraps hf_zero.initialize
    ("deepspeed", "DeepSpeedEngine", "hf_zero.runtime.engine", "HfZeroEngine"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "hf_zero.runtime.engine", "HfZeroEngine"),
    ("deepspeed.zero", "Init", "hf_zero.zero", "Init"),
    ("deepspeed.zero", "GatheredParameters", "hf_zero.zero", "GatheredParameters"),
    ("deepspeed.zero", "register_external_parameter", "hf_zero.zero", "register_external_parameter"),
    ("deepspeed.utils", "set_z3_leaf_modules", "hf_zero.zero", "set_z3_leaf_modules"),
    ("deepspeed.utils.groups", "_get_sequence_parallel_group", "hf_zero.comm", "get_sequence_parallel_group"),
    ("deepspeed.runtime.zero", "partition_parameters", "hf_zero.zero.init", None),
]:
    key = f"{shim_mod}.{name}"
    try:
        value = deepspeed
        for attr in [*shim_mod.split(".")[1:], name]:  # attribute chains, as HF code reads them
            value = getattr(value, attr)
    except (AttributeError, ImportError) as e:
        wanted = target_mod if target_name is None else f"{target_mod}.{target_name}"
        pending[key] = ["missing", wanted in str(e) or (target_name is None and target_mod in str(e)), str(e)]
        continue
    target = importlib.import_module(target_mod)
    pending[key] = ["resolved", value is (target if target_name is None else getattr(target, target_name)), ""]
out["pending"] = pending

import transformers.integrations, accelerate.utils
out["transformers_available"] = transformers.integrations.is_deepspeed_available()
out["accelerate_available"] = accelerate.utils.is_deepspeed_available()
from transformers.integrations.deepspeed import HfDeepSpeedConfig  # runs dep_version_check("deepspeed")
out["hf_zero3"] = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}}).is_zero3()
print(json.dumps(out))
"""


def test_import_deepspeed_resolves_into_hf_zero(venv, tmp_path):
    out = _json(_run(venv, SHIM_CHECKS, cwd=tmp_path))
    assert out["torch_at_startup"] is False  # the start-up hook stays cheap
    assert out["hf_zero_at_startup"] is True
    assert out["spec_origin"] == str(SHIM_TREE / "__init__.py")
    assert out["file"] == str(SHIM_TREE / "__init__.py")
    assert out["version"] == out["__version__"] == "0.19.8+hfzero.0.1.0"
    assert out["metadata_name"] == "deepspeed"
    assert "hf_zero's DeepSpeed compatibility layer" in out["summary"]
    assert out["listed"] == []  # distributions() listings never include the shim
    assert out["VALID_LR_SCHEDULES"] == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert out["same_objects"] == {key: True for key in out["same_objects"]}
    assert out["comm_calls"] == [False, 0, 1]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert out["accelerator"][0] == ("cuda:0" if device == "cuda" else "cpu")
    assert out["accelerator"][3] == ("nccl" if device == "cuda" else "gloo")
    assert out["env_name"] == os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    assert out["unknown_attr"].startswith("module 'deepspeed' has no attribute 'no_such_name'")
    for key, (state, ok, message) in out["pending"].items():
        assert ok, f"{key}: {state} {message}"
    assert out["transformers_available"] is True
    assert out["accelerate_available"] is True
    assert out["hf_zero3"] is True


def test_pip_does_not_see_the_shim(venv, tmp_path):
    pip = [str(venv), "-m", "pip", "--disable-pip-version-check", "--no-input"]

    def run(*args):
        return subprocess.run(pip + list(args), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)

    listed = run("list", "--format=json")
    assert listed.returncode == 0, listed.stderr
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "deepspeed" not in names
    assert "torch" in names  # the listing itself works and sees the system packages
    # The resolver treats deepspeed as absent: with no index to install from, it must fail to satisfy it.
    dry = run("install", "--dry-run", "--no-index", "deepspeed")
    assert dry.returncode != 0
    assert "No matching distribution found for deepspeed" in dry.stderr
    checked = run("check")
    assert "deepspeed" not in (checked.stdout + checked.stderr).lower()


def test_disable_env_var_turns_everything_off(venv, tmp_path):
    code = """
    import importlib.metadata as md, importlib.util, json, sys
    out = {"hf_zero_at_startup": "hf_zero" in sys.modules, "spec": importlib.util.find_spec("deepspeed") is None}
    try:
        md.version("deepspeed")
    except md.PackageNotFoundError:
        out["metadata"] = "PackageNotFoundError"
    try:
        import deepspeed
    except ModuleNotFoundError as e:
        out["import"] = str(e)
    print(json.dumps(out))
    """
    out = _json(_run(venv, code, cwd=tmp_path, **{DISABLE: "1"}))
    assert out == {"hf_zero_at_startup": False, "spec": True, "metadata": "PackageNotFoundError",
                   "import": "No module named 'deepspeed'"}


def _fake_deepspeed(root: Path, *, module: bool, dist_info: bool) -> Path:
    if module:
        (root / "deepspeed").mkdir(parents=True)
        (root / "deepspeed" / "__init__.py").write_text("__version__ = '0.15.0'\nREAL = True\n")
    if dist_info:
        info = root / "deepspeed-0.15.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.15.0\n")
    return root


def test_a_real_deepspeed_wins(venv, tmp_path):
    code = """
    import importlib.metadata as md, importlib.util, json
    spec = importlib.util.find_spec("deepspeed")
    out = {"origin": spec and spec.origin}
    try:
        out["version"] = md.version("deepspeed")
    except md.PackageNotFoundError:
        out["version"] = None
    print(json.dumps(out))
    """
    # module + dist-info earlier on sys.path: that package and its version, the shim is not consulted
    real = _fake_deepspeed(tmp_path / "real", module=True, dist_info=True)
    out = _json(_run(venv, code, cwd=tmp_path, PYTHONPATH=str(real)))
    assert out == {"origin": str(real / "deepspeed" / "__init__.py"), "version": "0.15.0"}
    # a source checkout without metadata: still DeepSpeed's code, and no shim version claiming it is installed
    checkout = _fake_deepspeed(tmp_path / "checkout", module=True, dist_info=False)
    out = _json(_run(venv, code, cwd=tmp_path, PYTHONPATH=str(checkout)))
    assert out == {"origin": str(checkout / "deepspeed" / "__init__.py"), "version": None}
    # a distribution without an importable module (e.g. a meta-path editable install): the shim stands aside
    dist_only = _fake_deepspeed(tmp_path / "dist_only", module=False, dist_info=True)
    out = _json(_run(venv, code, cwd=tmp_path, PYTHONPATH=str(dist_only)))
    assert out == {"origin": None, "version": "0.15.0"}
    # a plain folder named deepspeed (no __init__.py, e.g. of config files) in the working directory is not
    # DeepSpeed: the shim still answers
    (tmp_path / "configs_dir" / "deepspeed").mkdir(parents=True)
    out = _json(_run(venv, code, cwd=tmp_path / "configs_dir"))
    assert out == {"origin": str(SHIM_TREE / "__init__.py"), "version": "0.19.8+hfzero.0.1.0"}


def test_startup_cost_is_small(venv, tmp_path):
    def fastest(env: dict[str, str], runs: int = 7) -> float:
        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run([str(venv), "-c", "pass"], cwd=tmp_path, env=env, check=True)
            best = min(best, time.perf_counter() - start)
        return best

    fastest(_env())  # warm the page cache and .pyc files
    with_shim, without_shim = fastest(_env()), fastest(_env(**{DISABLE: "1"}))
    # The hook costs a few ms (mostly hf_zero/__init__'s `typing` import); 0.1 s absorbs this shared machine's noise.
    assert with_shim - without_shim < 0.1, (with_shim, without_shim)


def test_installed_pth_matches_the_source():
    installed = [Path(p) / PTH.name for p in site.getsitepackages() if (Path(p) / PTH.name).exists()]
    if not installed:
        pytest.skip("hf_zero is not installed in this interpreter's site-packages (no hf_zero_deepspeed.pth there)")
    for path in installed:
        assert path.read_text() == PTH.read_text(), f"{path} is stale; reinstall hf_zero"


# --- the small hf_zero modules the shim forwards to --------------------------------------------------------------


def test_clone_tensors_for_torch_save():
    base = torch.arange(6.0)
    view = base[2:4]
    state = torch.nn.Linear(2, 2).state_dict()
    item = {"view": view, "nested": [view, (view, 3)], "state": state, "text": "keep"}
    cloned = clone_tensors_for_torch_save(item)
    assert torch.equal(cloned["view"], torch.tensor([2.0, 3.0]))
    assert cloned["view"].untyped_storage().nbytes() == 2 * 4  # compact: only the viewed elements
    assert cloned["view"].data_ptr() != view.data_ptr()
    assert isinstance(cloned["nested"][1], tuple) and cloned["nested"][1][1] == 3
    assert type(cloned["state"]) is type(state)
    assert cloned["state"]._metadata == state._metadata
    assert cloned["text"] == "keep"
    view.add_(100.0)  # the copy does not follow later edits
    assert cloned["view"].tolist() == [2.0, 3.0]
    assert clone_tensors_for_torch_save(torch.ones(2, requires_grad=True), device="cpu").requires_grad is False


def test_accelerator_answers_like_deepspeed():
    cpu = Accelerator("cpu")
    assert [cpu.device_name(), cpu.device_name(3), cpu.current_device_name(), cpu.is_available()] == \
        ["cpu", "cpu", "cpu", True]
    cuda = Accelerator("cuda")
    assert [cuda.device_name(), cuda.device_name("1")] == ["cuda", "cuda:1"]  # transformers passes LOCAL_RANK text
    with pytest.raises(ValueError, match="unsupported accelerator device type 'xpu'"):
        Accelerator("xpu")
    acc = get_accelerator()
    assert acc is get_accelerator()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.device_name() == expected
    assert acc.communication_backend_name() == ("nccl" if expected == "cuda" else "gloo")


def test_deepspeed_config_error_catches_a_refused_config():
    """``except deepspeed.DeepSpeedConfigError`` (DeepSpeed's own checkpoint tests use it) catches hf_zero's refusal
    of a config value, which names the key."""
    import importlib

    ds = importlib.import_module("hf_zero.integrations.deepspeed_shim.deepspeed")
    runtime_config = importlib.import_module("hf_zero.integrations.deepspeed_shim.deepspeed.runtime.config")
    assert ds.DeepSpeedConfigError is runtime_config.DeepSpeedConfigError
    from hf_zero.config.loader import load_config

    with pytest.raises(ds.DeepSpeedConfigError, match="checkpoint.tag_validation: value 'foo'"):
        load_config({"train_batch_size": 1, "checkpoint": {"tag_validation": "foo"}}, world_size=1)


def test_version_parts_and_build_info_as_deepspeed_exports_them():
    import importlib

    ds = importlib.import_module("hf_zero.integrations.deepspeed_shim.deepspeed")
    parts = [int(p) for p in ds.__version__.split("+")[0].split(".")]
    assert [ds.__version_major__, ds.__version_minor__, ds.__version_patch__] == parts[:3]
    assert isinstance(ds.__git_hash__, str) and isinstance(ds.__git_branch__, str)
