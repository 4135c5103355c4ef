"""Build hooks for hf-zero; the project metadata lives in pyproject.toml.

At install time (``pip install --no-build-isolation [-e] .``) this compiles csrc/ with torch.utils.cpp_extension:

* ``hf_zero._C``      -- CPU kernels, always (-O3, OpenMP, the C++ standard torch's headers require).
* ``hf_zero._C_cuda`` -- CUDA kernels, only when the installed torch has CUDA and ``nvcc`` is found.

A failed compilation fails the install, with the compiler's own error and the way out: hf_zero's ops are the
fast path of every step (the pure-PyTorch references run 5-7x slower on a GPU), so an install that silently
dropped them would leave a user training slowly without knowing why. ``HF_ZERO_BUILD_OPS=0`` installs without
compiling on purpose; every op then runs its pure-PyTorch reference and the first op used warns once (``hf-zero
doctor`` shows which ops are compiled). A torch with CUDA but no ``nvcc`` builds the CPU kernels only and says so.

The C++ standard is torch's (BuildExtension adds the one its headers need: C++17 in torch 2.11, C++20 in
2.13); csrc/ is written to compile under both. CUDA kernels are built for the GPUs this machine has when
``TORCH_CUDA_ARCH_LIST`` is unset (torch's own default would build for every architecture it knows: minutes
longer); with no GPU visible, torch's default list applies. ``MAX_JOBS`` limits parallel compile jobs (ninja), as
in every torch extension build. The CPU kernels are tuned for the building machine (-march=native);
``HF_ZERO_PORTABLE=1`` drops that when building a wheel for other machines.

It also installs ``hf_zero/integrations/hf_zero_deepspeed.pth`` (the startup hook of the ``deepspeed``
compatibility layer) into the root of site-packages, for regular and for editable (PEP 660) installs.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import sys
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"
PTH_SOURCE = Path("hf_zero", "integrations", "hf_zero_deepspeed.pth")
BUILD_OPS_ENV = "HF_ZERO_BUILD_OPS"


def _warn(message: str) -> None:
    bar = "=" * 78
    print(f"\n{bar}\nhf_zero: WARNING: {message}\n{bar}\n", file=sys.stderr, flush=True)


def _ops_enabled() -> bool:
    return os.environ.get(BUILD_OPS_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


def _relative_sources(pattern: str) -> list[str]:
    # setuptools wants paths relative to setup.py
    return sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob(pattern))


def _extensions() -> list:
    if not _ops_enabled():
        _warn(f"{BUILD_OPS_ENV}=0: compiled ops skipped; every op will use its pure-PyTorch reference.")
        return []
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:  # torch missing from the build environment (e.g. pip without --no-build-isolation)
        _warn(f"torch is not importable at build time ({exc}); compiled ops skipped. Install torch first and "
              "reinstall with: pip install --no-build-isolation .")
        return []

    # The extension is compiled on the machine that runs it (like DeepSpeed's JIT op builder), so tuning for
    # the host CPU is safe and lets the compiler vectorize the fp32/bf16/fp16 loops with the widest SIMD it
    # has. Building a wheel for other machines: set HF_ZERO_PORTABLE=1 to drop -march=native.
    native = [] if os.environ.get("HF_ZERO_PORTABLE") == "1" else ["-march=native"]
    # -ffp-contract=off: no fused multiply-add contraction, so the kernels round each operation as the unfused
    # torch reference does (CPUAdam then tracks torch.optim.AdamW to ~1 ulp); they are memory-bound anyway.
    # No -std flag: BuildExtension adds the standard the installed torch's headers need (C++17 or C++20 by version;
    # forcing one breaks the other). csrc/ compiles under both (tests/test_build.py checks each).
    cxx_flags = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", *native]
    include_dirs = [str(CSRC / "common")]
    extensions = [
        cpp_extension.CppExtension(
            name="hf_zero._C",
            sources=_relative_sources("*.cpp"),
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
    ]
    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is None:
        _warn(f"torch {torch.__version__} has CUDA but no CUDA toolkit (nvcc) was found: hf_zero._C_cuda skipped, "
              "CUDA tensors will use the pure-PyTorch references. Set CUDA_HOME and reinstall to build it.")
    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None:
        _default_cuda_arch_list(torch)
        extensions.append(
            cpp_extension.CUDAExtension(
                name="hf_zero._C_cuda",
                sources=_relative_sources("*.cu"),
                include_dirs=include_dirs,
                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
            )
        )
    return extensions


def _default_cuda_arch_list(torch) -> None:
    """TORCH_CUDA_ARCH_LIST unset: build for the architectures of the GPUs this machine has (e.g. "9.0" on an
    H100), the machine the install is for. Without a visible GPU torch's default list applies."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(count)})
    except Exception:  # a driver problem: leave the choice to torch (it builds for every architecture)
        return
    if caps:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{major}.{minor}" for major, minor in caps)
        print(f"hf_zero: building CUDA kernels for this machine's GPUs: TORCH_CUDA_ARCH_LIST="
              f"{os.environ['TORCH_CUDA_ARCH_LIST']} (set it to build for others)", file=sys.stderr, flush=True)


def _build_ext_base():
    try:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)
    except ImportError:
        return build_ext


class BuildOps(_build_ext_base()):
    """build_ext whose failure says what to do: the compiler's error is above it, and the install stops."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing, header mismatch, out of memory, ...
            _warn(
                f"compiling the hf_zero ops failed ({type(exc).__name__}: {exc}); the compiler's error is above.\n"
                "The install stops here rather than leave hf_zero running every op through its slow pure-PyTorch\n"
                "reference. Fix the error (a C++ compiler, nvcc matching torch's CUDA, enough memory: lower\n"
                f"MAX_JOBS), or install without the compiled ops on purpose with {BUILD_OPS_ENV}=0."
            )
            raise

class BuildPy(build_py):
    """Puts the deepspeed-compatibility .pth at the root of the (regular) wheel, i.e. of site-packages."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode and (ROOT / PTH_SOURCE).is_file():
            self.copy_file(str(ROOT / PTH_SOURCE), os.path.join(self.build_lib, PTH_SOURCE.name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode and (ROOT / PTH_SOURCE).is_file():
            outputs.append(os.path.join(self.build_lib, PTH_SOURCE.name))
        return outputs


class EditableWheel(editable_wheel):
    """PEP 660 editable wheel plus the deepspeed-compatibility .pth at the wheel root.

    setuptools' editable strategies only write their own path hooks into the wheel, and build_py's outputs do
    not reach it, so the .pth is appended to the finished wheel (with its RECORD line) after the base command.
    """

    def run(self) -> None:
        super().run()
        source = ROOT / PTH_SOURCE
        if not source.is_file():
            return
        wheels = sorted(Path(self.dist_dir).glob("*.editable-*.whl"), key=lambda p: p.stat().st_mtime)
        if not wheels:
            raise RuntimeError(f"hf_zero: no editable wheel found in {self.dist_dir} to add {PTH_SOURCE.name} to")
        _add_file_to_wheel(wheels[-1], PTH_SOURCE.name, source.read_bytes())


def _add_file_to_wheel(wheel_path: Path, arcname: str, data: bytes) -> None:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record_line = f"{arcname},sha256={digest},{len(data)}\n"
    tmp_path = wheel_path.with_suffix(".tmp")
    with zipfile.ZipFile(wheel_path) as src, zipfile.ZipFile(tmp_path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename == arcname:
                continue
            content = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [ln for ln in content.decode().splitlines(keepends=True) if not ln.startswith(arcname + ",")]
                content = (record_line + "".join(lines)).encode()
            dst.writestr(info, content)
        dst.writestr(arcname, data)
    tmp_path.replace(wheel_path)


setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildOps, "build_py": BuildPy, "editable_wheel": EditableWheel},
)
