#!/usr/bin/env bash
# Runs a peer's own DeepSpeed tests (accelerate, transformers, peft) from its checkout on hf_zero and, with
# --ds-python, on DeepSpeed; prints both counts and the tests DeepSpeed passes and hf_zero fails.
#   scripts/peer_suites.sh PEER_CHECKOUT [--ds-python PATH] [--timeout S] [--engines hf_zero,deepspeed] [-- PYTEST_ARGS]
# PYTHON picks the interpreter with hf_zero (default: python3). See docs/peer_suites.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python3}" "$here/peer_suites/run.py" "$@"
