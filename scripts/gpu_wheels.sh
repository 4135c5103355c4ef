#!/usr/bin/env bash
# Download, on a machine with the package index, what the GPU machine's image lacks and cannot fetch (it has no
# network), into .gpu/whl (git-ignored; a `device` call carries it with `carry: [".gpu"]`):
#   - bitsandbytes, for QLoRA under ZeRO-3 (scripts/gpu_check.sh, step qlora_zero3);
#   - DeepSpeed 0.19.8 (an sdist, built there with DS_BUILD_OPS=0; it JIT-builds its ops on first use) and the
#     wheels it needs that the image lacks, for the side-by-side runs of benchmarks/bench_gpu.py (step ds_install).
# The GPU image runs python 3.12 on x86_64 (../shared/gpu/README.md).
set -eu
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
DEST=.gpu/whl
mkdir -p "$DEST"
WHEEL=(--no-deps --only-binary :all: --python-version 3.12 --platform manylinux_2_17_x86_64
       --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 -d "$DEST")
$PIP download "${WHEEL[@]}" bitsandbytes==0.50.2
$PIP download --no-deps --no-binary :all: -d "$DEST" deepspeed==0.19.8
$PIP download "${WHEEL[@]}" hjson pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
  "typing-extensions>=4.16"
ls -la "$DEST"
