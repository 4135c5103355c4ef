#!/usr/bin/env bash
# The main job: set-up (idempotent), then a real fine-tuning run on 2 CPU processes: the unchanged Hugging Face
# Trainer with a DeepSpeed ZeRO-3 JSON config, on a Llama built from config (partitioned as it is built) and on
# local data. Checkpoints, the final model.safetensors and a model card land in out/trainer/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m hf_zero doctor || true
torchrun --nproc_per_node 2 examples/train_trainer.py --deepspeed integrations/ds_config_zero3.json "$@"
