#!/usr/bin/env bash
# The Txt2SQL CPU smoke run with TRL: a tiny Qwen2 built here, 2 questions on synthetic SQLite databases,
# 2 GRPO steps of 1 prompt x 2 completions on ArcticGRPOTrainer, the arctic training engine and native sampler.
#
#   recipes/txt2sql/trl/run_cpu_smoke.sh [hydra overrides...]
#
# WORK (default: a fresh temporary directory) receives the model, the data and the run (trainer_state.json).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
WORK="${WORK:-$(mktemp -d -t arctic-rl-trl-txt2sql-XXXXXX)}"

cd "$REPO"
python -m arctic_rl_core.models.tiny "$WORK/tiny-qwen2" --family qwen2
python -m recipes.txt2sql.data --out "$WORK/txt2sql" --source synthetic --limit 2

exec python -m recipes.trl_main --config-path "$HERE" --config-name arctic_txt2sql_cpu \
    model="$WORK/tiny-qwen2" data.train_files="$WORK/txt2sql/train.parquet" grpo.output_dir="$WORK/run" "$@"
