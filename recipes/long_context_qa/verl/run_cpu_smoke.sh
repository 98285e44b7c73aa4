#!/usr/bin/env bash
# The long-context QA CPU smoke run: a tiny Qwen2 built here, 2 synthetic contexts of 1K tokens with
# 2 questions each, 2 GRPO steps (one context, 2 questions x 2 samples, per step) on verl's trainer
# with arctic-rl's engines and ZoRRo Train.
#
#   recipes/long_context_qa/verl/run_cpu_smoke.sh [hydra overrides...]
#
# WORK (default: a fresh temporary directory) receives the model, the data, verl's checkpoints dir,
# the metrics (metrics.jsonl, verl's file logger) and Hydra's outputs (hydra/); nothing is written in the repository.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
WORK="${WORK:-$(mktemp -d -t arctic-rl-verl-lcqa-XXXXXX)}"

cd "$REPO"
python -m arctic_rl_core.models.tiny "$WORK/tiny-qwen2" --family qwen2
python -m recipes.long_context_qa.data --out "$WORK/lcqa" --dataset synthetic --tokenizer "$WORK/tiny-qwen2" \
    --context-tokens 1024 --contexts 2 --test-contexts 1 --questions-per-context 2

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# verl's file logger would write <project_name>/<experiment_name>.jsonl into the current directory
# (the repository), and Hydra its outputs/ dir: both go under WORK.
export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-$WORK/metrics.jsonl}"
exec python -m verl.trainer.main_ppo --config-path "$HERE" --config-name arctic_long_context_qa_cpu \
    actor_rollout_ref.model.path="$WORK/tiny-qwen2" \
    data.train_files="$WORK/lcqa/train.parquet" data.val_files="$WORK/lcqa/test.parquet" \
    trainer.default_local_dir="$WORK/checkpoints" hydra.run.dir="$WORK/hydra" "$@"
