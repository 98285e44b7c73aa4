#!/usr/bin/env bash
# ArcticGRPOTrainer on GSM8K, on a CPU: a tiny Qwen2 made on the spot, 16 problems from
# ../shared/data/gsm8k, $STEPS GRPO steps (default 3) on the arctic training engine and native sampler.
#
#   bash recipes/gsm8k/trl/run_cpu_smoke.sh [more recipes.gsm8k.trl.train options ...]
#
# OUT_DIR (default /tmp/arctic-rl-trl-smoke) receives the model, the data and the TRL checkpoints.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python="${PYTHON:-.venv/bin/python}"
out="${OUT_DIR:-/tmp/arctic-rl-trl-smoke}"
steps="${STEPS:-3}"

"$python" -m arctic_rl_core.models.tiny "$out/model" --family qwen2
"$python" -m recipes.gsm8k.data --out "$out/data" --source local --limit 16
"$python" -m recipes.gsm8k.trl.train \
    --data "$out/data" --model "$out/model" --out "$out/run" --cpu \
    --steps "$steps" --prompts-per-step 2 --num-generations 4 --max-completion-length 16 \
    --eval-steps "$steps" --save-steps "$steps" "$@"
