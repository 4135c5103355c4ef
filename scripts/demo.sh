#!/usr/bin/env bash
# The main job: set-up (idempotent), then a real fine-tuning run on every GPU (or 2 CPU processes): the unchanged
# Hugging Face Trainer with a DeepSpeed ZeRO-3 JSON config, on a Llama built from config (partitioned as it is
# built) and on local data. Checkpoints, the final model.safetensors and a model card land in out/trainer/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m hf_zero doctor || true
# one process per GPU where there are GPUs (NCCL takes one GPU per rank), else 2 CPU processes (gloo)
NPROC=${NPROC:-$(python3 -c "import torch; print(torch.cuda.device_count() or 2)")}
# the machine's cores split between the processes (torchrun would set 1 and say so)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
torchrun --nproc_per_node "$NPROC" examples/train_trainer.py --deepspeed integrations/ds_config_zero3.json "$@"
