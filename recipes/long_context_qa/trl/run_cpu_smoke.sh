#!/usr/bin/env bash
# The long-context QA CPU smoke run with TRL: a tiny Qwen2 built here, 2 synthetic contexts of 1K tokens
# with 2 questions each, 2 GRPO steps (one context, 2 questions x 2 completions, per step) on
# ArcticGRPOTrainer, the arctic training engine with ZoRRo Train and the native sampler.
#
#   recipes/long_context_qa/trl/run_cpu_smoke.sh [hydra overrides...]
#
# WORK (default: a fresh temporary directory) receives the model, the data and the run (trainer_state.json).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
WORK="${WORK:-$(mktemp -d -t arctic-rl-trl-lcqa-XXXXXX)}"

cd "$REPO"
python -m arctic_rl_core.models.tiny "$WORK/tiny-qwen2" --family qwen2
python -m recipes.long_context_qa.data --out "$WORK/lcqa" --dataset synthetic --tokenizer "$WORK/tiny-qwen2" \
    --context-tokens 1024 --contexts 2 --test-contexts 1 --questions-per-context 2

exec python -m recipes.trl_main --config-path "$HERE" --config-name arctic_long_context_qa_cpu \
    model="$WORK/tiny-qwen2" data.train_files="$WORK/lcqa/train.parquet" grpo.output_dir="$WORK/run" "$@"
