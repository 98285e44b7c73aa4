#!/usr/bin/env bash
# GSM8K with TRL on a CPU: a tiny Qwen2 made on the spot, 16 problems from ../shared/data/gsm8k,
# 3 GRPO steps on ArcticGRPOTrainer (the arctic training engine and native sampler), one evaluation
# and one checkpoint.
#
#   recipes/gsm8k/trl/run_cpu_smoke.sh [hydra overrides...]      # e.g. trainer=trl: TRL's own GRPOTrainer
#
# WORK (default: a fresh temporary directory) receives the model, the data and the run
# (checkpoint-3/, trainer_state.json).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
WORK="${WORK:-$(mktemp -d -t arctic-rl-trl-gsm8k-XXXXXX)}"

cd "$REPO"
python -m arctic_rl_core.models.tiny "$WORK/tiny-qwen2" --family qwen2
python -m recipes.gsm8k.data --out "$WORK/gsm8k" --source local --limit 16

exec python -m recipes.trl_main --config-path "$HERE" --config-name arctic_gsm8k_cpu \
    model="$WORK/tiny-qwen2" data.train_files="$WORK/gsm8k/train.parquet" \
    data.eval_files="$WORK/gsm8k/test.parquet" grpo.output_dir="$WORK/run" "$@"
