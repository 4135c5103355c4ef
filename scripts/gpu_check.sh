#!/usr/bin/env bash
# The GPU checks in one go, on a machine with one or more CUDA GPUs (about 8 minutes on one H100):
#
#     bash scripts/gpu_check.sh OUT_DIR
#
# 1. install hf_zero into the machine's Python against its own torch (nothing downloaded, nothing replaced; the
#    ops compile for the visible GPU's architecture) and `hf-zero doctor`;
# 2. the GPU tests (pytest -m gpu) and the op tests, which run their CUDA cases where a GPU is visible;
# 3. every user path on one GPU: README's main job (Trainer + ZeRO-3), `accelerate launch` with the ZeRO-2 config,
#    PEFT LoRA under ZeRO-3, the `deepspeed` command;
#    QLoRA (bitsandbytes 4-bit base) under ZeRO-3 when a bitsandbytes wheel is carried in .gpu/whl (the GPU image
#    has none and no network);
# 4. benchmarks/bench_kernels.py (CUDA kernels against torch's), benchmarks/profile_gpu_step.py (host issue time,
#    synchronisations and top operators of one step per runner) and benchmarks/bench_gpu.py (one round; with
#    DeepSpeed's runners in the same round when its wheels are carried in .gpu/whl: scripts/gpu_wheels.sh), and
#    bench_compile: the same with torch.compile (torch, ZeRO-0, ZeRO-3 each eager and compiled).
# Each step has its own time limit and log under OUT_DIR; OUT_DIR/summary.txt has one line per step with its exit
# status and seconds. A step that fails does not stop the others. Exit status: the number of failed steps.
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
failed=0

# GPU_CHECK_STEPS="install gpu_tests ...": run only these steps (default: all)
step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then return; fi
  local start=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local line="$name rc=$rc $(( $(date +%s) - start ))s"
  [ $rc -eq 0 ] || failed=$((failed + 1))
  echo "$line" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || grep -E "Error|Exception|error:|FAILED|^E " "$OUT/$name.log" | tail -n 15 | cut -c1-400 | sed "s/^/  [$name] /"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, transformers, accelerate, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)"
  git log -1 --format='%H %s' 2>/dev/null; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step install 400 "$PY" -m pip install --no-build-isolation --no-deps --no-index -v -e .
step doctor 60 "$PY" -m hf_zero doctor
step gpu_tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_two_ranks.py \
  tests/test_gpu_offload_features.py \
  tests/test_build.py::test_cuda_extension_loaded_on_gpu_machine tests/test_ds_activation_checkpointing.py
step trainer_zero3 240 torchrun --nproc_per_node 1 examples/train_trainer.py \
  --deepspeed integrations/ds_config_zero3.json --output_dir "$WORK/trainer" --metrics_out "$OUT/trainer_metrics.json"
step accelerate_zero2 180 accelerate launch --config_file integrations/accelerate_zero2.yaml --num_processes 1 \
  examples/accelerate_train.py --output_dir "$WORK/accelerate"
step lora_zero3 180 torchrun --nproc_per_node 1 examples/lora_train.py \
  --deepspeed integrations/ds_config_zero3.json --output_dir "$WORK/lora"
qlora() {  # bitsandbytes from a carried wheel, into a directory of its own (nothing in the image changes)
  local whl
  whl=$(ls .gpu/whl/bitsandbytes-*.whl 2>/dev/null | head -n 1)
  [ -n "$whl" ] || { echo "no bitsandbytes wheel in .gpu/whl"; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --target "$WORK/bnb" "$whl" || return 1
  PYTHONPATH="$WORK/bnb${PYTHONPATH:+:$PYTHONPATH}" torchrun --nproc_per_node 1 examples/lora_train.py \
    --deepspeed integrations/ds_config_zero3.json --load_in_4bit --output_dir "$WORK/qlora"
}
export PY WORK
export -f qlora
step qlora_zero3 180 bash -c qlora
step deepspeed_command 180 deepspeed --num_gpus 1 examples/finetune_native.py --stage 2 --steps 20 --output "$WORK/native"
step ops_tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_ops_adam.py tests/test_ops_norm.py \
  tests/test_ops_basic.py tests/test_ops_reduce.py tests/test_ops_transformer.py
ds_install() {  # DeepSpeed from carried wheels (scripts/gpu_wheels.sh), into directories of its own
  local sdist
  sdist=$(ls .gpu/whl/deepspeed-*.tar.gz 2>/dev/null | head -n 1)
  [ -n "$sdist" ] || { echo "no DeepSpeed sdist in .gpu/whl (scripts/gpu_wheels.sh)"; return 1; }
  rm -rf "$DS_SITE" && mkdir -p "$DS_SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$DS_SITE/deps" \
    $(ls .gpu/whl/*.whl | grep -v bitsandbytes) || return 1
  DS_BUILD_OPS=0 PYTHONPATH="$DS_SITE/deps" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
    --target "$DS_SITE/ds" "$sdist" || return 1
  HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 PYTHONPATH="$DS_SITE/ds:$DS_SITE/deps" "$PY" -c \
    "import deepspeed; print('deepspeed', deepspeed.__version__, deepspeed.__file__)"
}
export DS_SITE=${DS_SITE:-/tmp/hf_zero_gpu_ds}
export -f ds_install
step ds_install 240 bash -c ds_install
DS_ARGS=()  # DeepSpeed's runners only where ds_install (this run or an earlier one) left an importable DeepSpeed
if [[ -z "${GPU_CHECK_STEPS:-}" || " $GPU_CHECK_STEPS " == *" bench "* ]] && [ -d "$DS_SITE/ds/deepspeed" ] &&
    HF_ZERO_DISABLE_DEEPSPEED_SHIM=1 PYTHONPATH="$DS_SITE/ds:$DS_SITE/deps" \
    "$PY" -c "import deepspeed" >/dev/null 2>&1; then
  DS_ARGS=(--deepspeed-path "$DS_SITE/ds:$DS_SITE/deps")
fi
step kernels 180 "$PY" benchmarks/bench_kernels.py --device cuda
step profile 300 "$PY" benchmarks/profile_gpu_step.py "$OUT/profile" --only torch,fsdp2,z0,z3,z2_offload
step bench 480 "$PY" benchmarks/bench_gpu.py --rounds 1 --json "$OUT/bench.jsonl" "${DS_ARGS[@]}"
# torch.compile: torch's loop and hf_zero stages 0 and 3 each eager and compiled (docs/compile.md)
step bench_compile 420 "$PY" benchmarks/bench_gpu.py --rounds 1 --only torch,z0,z3 --compiled \
  --json "$OUT/bench_compile.jsonl"
rm -rf "$WORK"
echo "failed steps: $failed" | tee -a "$OUT/summary.txt"
tar -C "$OUT" -czf "$OUT/../gpu_check_logs.tgz" . 2>/dev/null || true  # one file: what comes back from a lent GPU
exit $failed
