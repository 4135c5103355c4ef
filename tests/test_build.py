"""The install-time build: regular and editable installs (with the deepspeed-compatibility .pth at the root of
site-packages), HF_ZERO_BUILD_OPS=0, a failing compiler that fails the install with its error and the way out, and
a compile check of every C++ and CUDA source under both C++ standards torch's extension builders use (C++17 in torch
2.11, the GPU image's; C++20 in 2.13). (A real compile at install is exercised by every developer install;
it takes minutes, so these tests install without one.)

Installs go into throw-away virtual environments (which import torch, setuptools and pip from this interpreter) from
a copy of the sources, so the shared checkout and the real site-packages are never touched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from _hf_env import make_venv

REPO = Path(__file__).resolve().parents[1]
PTH = Path("hf_zero", "integrations", "hf_zero_deepspeed.pth")


def _copy_sources(dest: Path, pth_line: str | None) -> Path:
    src = dest / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    shutil.copytree(REPO / "hf_zero", src / "hf_zero", ignore=ignore)
    shutil.copytree(REPO / "csrc", src / "csrc", ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    if pth_line is not None:  # a marker .pth of our own, so the test does not depend on the shim's content
        (src / PTH).write_text(pth_line + "\n")
    return src


def _venv(path: Path) -> Path:
    """A venv that sees this interpreter's packages (torch, setuptools, pip) but not this checkout."""
    return make_venv(path, with_checkout=False)


def _pip_install(python: Path, src: Path, *args: str, expect_rc: int = 0, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", *args, str(src)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "MAX_JOBS": "2", **env}, cwd=src.parent,
    )
    ok = result.returncode == 0 if expect_rc == 0 else result.returncode != 0
    assert ok, f"rc={result.returncode}\n" + result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _probe(python: Path, code: str) -> str:
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr
    return result.stdout


MARKER = "import os; os.environ['HF_ZERO_TEST_PTH_RAN'] = '1'"
PROBE = ("import os, hf_zero; from hf_zero.ops._native import extension_status as s; "
         "print(os.environ.get('HF_ZERO_TEST_PTH_RAN'), hf_zero.__file__, s('cpu').reason, sep='|')")


def _broken_compiler(tmp_path: Path) -> Path:
    broken = tmp_path / "broken-cxx"
    # answers torch's version probe as the real compiler does, fails every compilation
    real = shutil.which("c++") or shutil.which("g++") or "false"
    broken.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ] || [ \"$1\" = -v ]; then exec {real} \"$@\"; fi\n"
                      "echo 'simulated compiler failure' >&2\nexit 1\n")
    broken.chmod(0o755)
    return broken


def test_failed_compile_fails_the_install_with_the_compiler_error_and_the_way_out(tmp_path):
    """The decision (setup.py's docstring): a compile error stops the install -- pip shows the compiler's message
    and hf_zero's, which names HF_ZERO_BUILD_OPS=0 -- instead of installing ops that silently fall back to their
    5-7x slower references. Nothing is left installed."""
    src = _copy_sources(tmp_path, MARKER)
    python = _venv(tmp_path / "venv")
    broken = str(_broken_compiler(tmp_path))
    result = _pip_install(python, src, "-v", expect_rc=1, CXX=broken, CC=broken)
    out = result.stdout + result.stderr
    assert "simulated compiler failure" in out, out[-3000:]
    assert "compiling the hf_zero ops failed" in out and "HF_ZERO_BUILD_OPS=0" in out, out[-3000:]
    assert not list(_site_packages(python).glob("hf_zero*")), "a failed install must leave nothing behind"


def test_install_without_ops_on_purpose_puts_pth_in_site_packages(tmp_path):
    """HF_ZERO_BUILD_OPS=0 (editable): installs, says so, and the ops report "not built" (they fall back)."""
    src = _copy_sources(tmp_path, MARKER)
    python = _venv(tmp_path / "venv")
    result = _pip_install(python, src, "-v", "-e", HF_ZERO_BUILD_OPS="0")
    assert "HF_ZERO_BUILD_OPS=0: compiled ops skipped" in result.stdout + result.stderr

    site_packages = _site_packages(python)
    installed = site_packages / PTH.name
    assert installed.read_text().strip() == MARKER
    ran, location, reason = _probe(python, PROBE).split("|")
    assert ran == "1", "the .pth line must run at interpreter start-up"
    assert Path(location).resolve().is_relative_to(src.resolve())
    assert "not built" in reason, reason
    record = next(site_packages.glob("hf_zero-*.dist-info")) / "RECORD"
    assert PTH.name in record.read_text(), "pip uninstall must remove the .pth too"

    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "hf-zero"], check=True, capture_output=True)
    assert not installed.exists()


def test_wheel_ships_package_data_and_writes_a_model_card(tmp_path):
    """A wheel (not a checkout) must carry every non-Python file hf_zero reads: the model card template is read
    by HfZeroCallback at every save, so a wheel install without it fails at the first checkpoint."""
    import zipfile

    src = _copy_sources(tmp_path, None)
    dist = tmp_path / "dist"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                             "-w", str(dist), str(src)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_ZERO_BUILD_OPS": "0"}, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheel = next(dist.glob("hf_zero-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "hf_zero/integrations/templates/model_card.md" in names
    assert "hf_zero_deepspeed.pth" in names

    python = _venv(tmp_path / "venv")
    _pip_install(python, wheel)
    card_dir = tmp_path / "card"
    card_dir.mkdir()
    out = _probe(python, "import hf_zero, sys; from hf_zero.integrations.trainer_callback import write_model_card; "
                         f"print(hf_zero.__file__); print(write_model_card({str(card_dir)!r}, object()))")
    location, written = out.strip().splitlines()
    assert Path(location).resolve().is_relative_to(_site_packages(python).resolve())  # the wheel's copy, not ours
    text = Path(written).read_text()
    assert text.startswith("<!-- hf_zero:training -->") and "not trained by the ZeRO engine" in text
    assert "$" not in text.split("```")[0], "every template field must be filled"


# ---------------------------------------------------------------- CUDA sources


def _nvcc() -> str | None:
    # torch.utils.cpp_extension.CUDA_HOME is None under a CPU build of torch, so look for nvcc ourselves.
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _torch_include() -> Path:
    return Path(torch.__file__).parent / "include"


CUDA_SOURCES = sorted((REPO / "csrc").rglob("*.cu"))

# The one header a CPU wheel of torch lacks: c10/cuda/impl/cuda_cmake_macros.h is generated by CMake only in CUDA
# builds (every other c10/cuda header ships). Its entire content in CUDA wheels is this define; the stand-in goes
# in its own include directory, searched after torch's, so a torch that has the real file uses that.
CUDA_CMAKE_MACROS = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"


STANDARDS = ["c++17", "c++20"]  # torch 2.11's extension builder passes the first, 2.13's the second


def _digest(paths, *extra: str) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(REPO)).encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(extra).encode())
    return digest.hexdigest()[:16]


def _run_all(jobs: dict[str, list[str]], timeout: int) -> dict[str, subprocess.CompletedProcess]:
    """Run the compiler commands side by side (the suite's machine has 2 cores and each job is one process)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        futures = {name: pool.submit(subprocess.run, cmd, capture_output=True, text=True, timeout=timeout)
                   for name, cmd in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def test_cuda_sources_compile_with_nvcc_under_both_standards(tmp_path):
    """nvcc -c every .cu with torch's headers, as setup.py would on a CUDA machine, under C++17 and C++20.

    The CPU wheel of torch ships the c10/cuda and ATen/cuda headers except one CMake-generated file (see
    CUDA_CMAKE_MACROS); the kernels include only c10/cuda (see csrc/common/cuda_utils.cuh) plus the CUDA runtime,
    so the check runs against torch's real headers with that single one-line stand-in.

    Cost: one nvcc run per file took ~47 s on 2 cores (most of it parsing ATen's headers, in both of nvcc's
    passes), 12 runs ~9.5 minutes of a clean checkout's CI. The sources are compiled instead as one translation unit
    per standard (a file that #includes every .cu, in a fixed order), the two standards side by side: ~65 s. What
    this gives up: that each .cu compiles *alone* (a file relying on an include of a file before it). The install
    compiles each file alone -- every GPU install, and scripts/gpu_check.sh's first step -- so that is where such a
    miss would show. A successful compile is cached by content hash under build/, so it costs nothing until a
    source, header, torch or nvcc changes.
    """
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (no CUDA toolkit): CUDA sources not compile-checked")
    if not (_torch_include() / "c10" / "cuda" / "CUDAStream.h").exists():
        pytest.skip("this torch ships no c10/cuda headers: CUDA sources cannot be compile-checked")
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    assert CUDA_SOURCES, "no .cu file found under csrc/"
    # include_paths() without CUDA: torch's own headers; nvcc adds the toolkit's include directory itself.
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    standin = tmp_path / "standin"
    (standin / "c10" / "cuda" / "impl").mkdir(parents=True)
    (standin / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text(CUDA_CMAKE_MACROS)
    unity = tmp_path / "all_sources.cu"
    unity.write_text("".join(f'#include "{src}"\n' for src in CUDA_SOURCES))
    base = [*COMMON_NVCC_FLAGS, "-O1", "-Xcompiler", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *[f"-I{p}" for p in include_paths()],
            f"-I{REPO / 'csrc' / 'common'}", f"-I{sysconfig.get_paths()['include']}", f"-I{standin}"]
    headers = [*sorted((REPO / "csrc").rglob("*.h")), *sorted((REPO / "csrc").rglob("*.cuh"))]
    digest = _digest([*CUDA_SOURCES, *headers], torch.__version__, version, *base[:-1], CUDA_CMAKE_MACROS)
    stamps = {std: REPO / "build" / "nvcc_check" / f"all-{std}-{digest}.ok" for std in STANDARDS}
    jobs = {std: [nvcc, *base, f"-std={std}", "-c", str(unity), "-o", str(tmp_path / f"{std}.o")]
            for std in STANDARDS if not stamps[std].exists()}
    results = _run_all(jobs, timeout=1200)
    failed = {std: r.stderr[-6000:] for std, r in results.items() if r.returncode != 0}
    assert not failed, "nvcc failed on csrc/ (errors name the .cu file):\n" + "\n".join(
        f"--- -std={std}\n{err}" for std, err in failed.items())
    for std in results:
        stamps[std].parent.mkdir(parents=True, exist_ok=True)
        stamps[std].write_text(version)


CPP_SOURCES = sorted((REPO / "csrc").rglob("*.cpp"))


def test_cpp_sources_compile_as_cpp17(tmp_path):
    """The install compiles the C++ sources with the standard of the installed torch (C++20 here, 2.13); torch
    2.11's builder passes -std=c++17, and a C++20-only construct there fails the whole build (std::bit_cast did).
    A syntax-only pass under C++17 with torch's headers catches that here.

    Cost: one pass per file took ~12 s each (parsing torch's headers), 11 files ~69 s of a clean checkout's CI two at
    a time; all of them as one translation unit (a file that #includes every .cpp, in a fixed order) ~20 s. That
    needs the files' file-local names to differ (shared helpers live in csrc/common/utils.h). What it gives up, as
    the nvcc check does: that each file compiles *alone* -- the install compiles each alone, so a missing include
    shows there. Cached by content hash under build/ like the nvcc check."""
    from torch.utils.cpp_extension import include_paths

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    assert CPP_SOURCES, "no .cpp file found under csrc/"
    flags = ["-std=c++17", "-fsyntax-only", "-fopenmp",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *[f"-I{p}" for p in include_paths()],
             f"-I{REPO / 'csrc' / 'common'}", f"-I{sysconfig.get_paths()['include']}"]
    headers = sorted((REPO / "csrc").rglob("*.h"))
    digest = _digest([*CPP_SOURCES, *headers], torch.__version__, cxx, *flags)
    stamp = REPO / "build" / "cxx17_check" / f"all-{digest}.ok"
    if stamp.exists():
        return
    unity = tmp_path / "all_sources.cpp"
    unity.write_text("".join(f'#include "{src}"\n' for src in CPP_SOURCES))
    result = subprocess.run([cxx, *flags, str(unity)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, "not C++17 (errors name the .cpp file):\n" + result.stderr[-6000:]
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text("ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: CUDA kernels are compile-checked only")
def test_cuda_extension_loaded_on_gpu_machine():
    from hf_zero.ops._native import extension_status

    status = extension_status("cuda")
    assert status.loaded, status.reason
