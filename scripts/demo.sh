#!/usr/bin/env bash
# The main job: set-up (idempotent), then a real fine-tuning run on 2 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m hf_zero doctor || true
torchrun --nproc_per_node 2 examples/finetune_native.py --stage 2 --steps 30 "$@"
