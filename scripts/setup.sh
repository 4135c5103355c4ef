#!/usr/bin/env bash
# One-time, idempotent set-up on a fresh machine with nothing but Python: torch (CPU build, pinned so pip never
# pulls the multi-GB CUDA wheels), then hf-zero itself with its compiled ops, built at install time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  "$PY" -m pip install --quiet torch==2.13.0
fi
# --no-build-isolation: csrc/ compiles against the torch installed above, not a fresh (CUDA) one in a build env.
# setuptools/wheel/ninja are the build tools that flag makes pip expect to find already installed.
"$PY" -m pip install --quiet "setuptools>=64" wheel ninja
MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install --quiet --no-build-isolation -e ".[test]"
