#!/usr/bin/env bash
# The CPU smoke run: a tiny Qwen2 built here, 8 GSM8K problems from the local copy
# (<repo>/../shared/data/gsm8k or $ARCTIC_RL_DATA_DIR/gsm8k), 3 GRPO steps and one validation.
#
#   recipes/gsm8k/verl/run_cpu_smoke.sh [hydra overrides...]
#
# WORK (default: a fresh temporary directory) receives the model, the data, verl's checkpoints dir,
# the metrics (metrics.jsonl, verl's file logger) and Hydra's outputs (hydra/); nothing is written in the repository.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
WORK="${WORK:-$(mktemp -d -t arctic-rl-verl-XXXXXX)}"

cd "$REPO"
python -m arctic_rl_core.models.tiny "$WORK/tiny-qwen2" --family qwen2
python -m recipes.gsm8k.data --out "$WORK/gsm8k" --source local --limit 8

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# verl's file logger would write <project_name>/<experiment_name>.jsonl into the current directory
# (the repository), and Hydra its outputs/ dir: both go under WORK.
export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-$WORK/metrics.jsonl}"
exec python -m verl.trainer.main_ppo --config-path "$HERE" --config-name arctic_gsm8k_cpu \
    actor_rollout_ref.model.path="$WORK/tiny-qwen2" \
    data.train_files="$WORK/gsm8k/train.parquet" data.val_files="$WORK/gsm8k/test.parquet" \
    trainer.default_local_dir="$WORK/checkpoints" hydra.run.dir="$WORK/hydra" "$@"
