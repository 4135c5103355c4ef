"""Build hooks for hf-zero; the project metadata lives in pyproject.toml.

At install time (``pip install --no-build-isolation [-e] .``) this compiles csrc/ with torch.utils.cpp_extension:

* ``hf_zero._C``      -- CPU kernels, always (-O3, OpenMP, the C++ standard torch's headers require).
* ``hf_zero._C_cuda`` -- CUDA kernels, only when the installed torch has CUDA and ``nvcc`` is found.

``HF_ZERO_BUILD_OPS=0`` skips compilation. A failed compilation never fails the install: the error is printed and
every op falls back to its pure-PyTorch reference at run time (``hf-zero doctor`` shows which ops are compiled).
``MAX_JOBS`` limits parallel compile jobs (ninja), as in every torch extension build. The CPU kernels are tuned for
the building machine (-march=native); ``HF_ZERO_PORTABLE=1`` drops that when building a wheel for other machines.

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
    # No -std flag: BuildExtension adds the standard the installed torch headers need (C++20 since torch 2.10;
    # forcing -std=c++17 breaks them).
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
        extensions.append(
            cpp_extension.CUDAExtension(
                name="hf_zero._C_cuda",
                sources=_relative_sources("*.cu"),
                include_dirs=include_dirs,
                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
            )
        )
    return extensions


def _build_ext_base():
    try:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)
    except ImportError:
        return build_ext


class BuildOps(_build_ext_base()):
    """build_ext that turns a failed compilation into a warning: the ops then run their Python references."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing, header mismatch, out of memory, ...
            _warn(
                f"compiling the hf_zero ops failed ({type(exc).__name__}: {exc}).\n"
                "hf_zero is installed without them and every op falls back to its pure-PyTorch reference.\n"
                "Fix the compiler error above, then rebuild with: pip install --no-build-isolation -e .\n"
                f"(or skip compilation on purpose with {BUILD_OPS_ENV}=0)."
            )
            # Nothing was built: do not let install/editable_wheel look for the extension outputs.
            self.extensions = []
            self.distribution.ext_modules = []

    def get_outputs(self) -> list[str]:
        return [path for path in super().get_outputs() if os.path.exists(path)]


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
