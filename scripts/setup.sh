#!/usr/bin/env bash
# One-time, idempotent set-up on a fresh machine, CPU or GPU: torch (kept when a supported one is installed, so a
# GPU machine's CUDA build is never replaced; else torch 2.13.0, which on a machine without GPUs comes from the
# CPU wheels so pip never pulls the multi-GB CUDA ones), then hf-zero itself with its compiled ops, built at
# install time against that torch (CUDA kernels too where torch has CUDA and nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the range pyproject.toml declares (torch>=2.11): 2.11 is the oldest the ops are built and tested against
if "$PY" -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 11) else 1)" 2>/dev/null; then
  "$PY" -c "import torch; print(f'hf_zero set-up: keeping the installed torch {torch.__version__} (CUDA: {torch.version.cuda})')"
else
  "$PY" -m pip install --quiet torch==2.13.0
fi
# --no-build-isolation: csrc/ compiles against the torch above, not a fresh (CUDA) one in a build env.
# setuptools/wheel/ninja are the build tools that flag makes pip expect to find already installed.
"$PY" -m pip install --quiet "setuptools>=64" wheel ninja
# `setup.sh test` adds the test extras (pytest, bitsandbytes for the QLoRA tests, tensorboard for the monitor tests);
# the main job needs none of them, and bitsandbytes, once installed, logs a warning at every `import peft` on a
# CPU-only machine
TARGET="."
[ "${1:-}" = "test" ] && TARGET=".[test]"
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --quiet --no-build-isolation -e "$TARGET"
