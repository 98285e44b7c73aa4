#!/usr/bin/env bash
# The Txt2SQL CPU smoke run: a tiny Qwen2 built here, 2 questions on synthetic SQLite databases,
# 2 GRPO steps of 1 prompt x 2 samples on verl's trainer with arctic-rl's engines.
#
#   recipes/txt2sql/verl/run_cpu_smoke.sh [hydra overrides...]
#
# WORK (default: a fresh temporary directory) receives the model, the data, verl's checkpoints dir,
# the metrics (metrics.jsonl, verl's file logger) and Hydra's outputs (hydra/); nothing is written in the repository.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
WORK="${WORK:-$(mktemp -d -t arctic-rl-verl-txt2sql-XXXXXX)}"

cd "$REPO"
python -m arctic_rl_core.models.tiny "$WORK/tiny-qwen2" --family qwen2
python -m recipes.txt2sql.data --out "$WORK/txt2sql" --source synthetic --limit 2

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# verl's file logger would write <project_name>/<experiment_name>.jsonl into the current directory
# (the repository), and Hydra its outputs/ dir: both go under WORK.
export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-$WORK/metrics.jsonl}"
exec python -m verl.trainer.main_ppo --config-path "$HERE" --config-name arctic_txt2sql_cpu \
    actor_rollout_ref.model.path="$WORK/tiny-qwen2" \
    data.train_files="$WORK/txt2sql/train.parquet" data.val_files="$WORK/txt2sql/dev.parquet" \
    trainer.default_local_dir="$WORK/checkpoints" hydra.run.dir="$WORK/hydra" "$@"
