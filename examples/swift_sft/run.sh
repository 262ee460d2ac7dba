#!/usr/bin/env bash
# `swift sft` on a tiny generated model, offline on CPU, traced with no code change.
# Usage: examples/swift_sft/run.sh [NPROC]   (NPROC=2 runs two ranks with gloo)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${TINY_SFT_DIR:-/tmp/tiny-sft}"
[ -f "$root/train.jsonl" ] || python "$here/make_tiny.py" "$root"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MODELSCOPE_OFFLINE=1
export CUDA_VISIBLE_DEVICES=
export OTEL_SERVICE_NAME="${OTEL_SERVICE_NAME:-tiny-sft}"
extra=()
if [ -n "${1:-}" ]; then
  export NPROC_PER_NODE="$1"
  extra=(--ddp_backend gloo)
fi

opentelemetry-instrument swift sft \
  --model "$root/model" --model_type qwen2 --template qwen2_5 \
  --dataset "$root/train.jsonl" --val_dataset "$root/val.jsonl" \
  --tuner_type full --torch_dtype float32 --max_steps 10 \
  --per_device_train_batch_size 2 --logging_steps 2 --eval_steps 5 --save_steps 5 \
  --max_length 128 --dataset_num_proc 1 --dataloader_num_workers 0 --report_to none \
  --check_model false --add_version false --output_dir "$root/out" "${extra[@]}"
