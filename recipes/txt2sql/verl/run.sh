#!/usr/bin/env bash
# Txt2SQL GRPO on GPUs: verl 0.9.1's trainer, arctic-rl's engines (Qwen3-8B on Spider, one node of 8 GPUs).
#
#   SPIDER=~/spider_data recipes/txt2sql/verl/run.sh [hydra overrides...]
#
# The run is txt2sql_grpo.yaml. Examples of overrides:
#   actor_rollout_ref.model.path=/models/Qwen3-8B                    (a local copy of the weights)
#   actor_rollout_ref.actor.arctic.sampling_engine=native             (arctic's own sampler instead of vLLM)
#   +reward.custom_reward_function.reward_kwargs.timeout_s=10         (BIRD's slowest gold queries)
# DATA (default ~/data/spider) receives train.parquet and dev.parquet, made from the Spider release in
# SPIDER when missing (https://yale-lily.github.io/spider). For BIRD, prepare the data with
# python -m recipes.txt2sql.data --source bird and point DATA at it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
# Checkpoints, Hydra's outputs and (with trainer.logger including file) metrics.jsonl; the default is
# runs/txt2sql-verl in the repository (git-ignored), never the bare relative paths verl's config names.
OUT="${OUT:-$REPO/runs/txt2sql-verl}"
DATA="${DATA:-$HOME/data/spider}"

cd "$REPO"
if [ ! -f "$DATA/train.parquet" ]; then
    python -m recipes.txt2sql.data --out "$DATA" --source spider \
        --root "${SPIDER:?set SPIDER to the unzipped Spider release}"
fi

# verl's processes hold no GPU: arctic-rl places all the compute (integrations/arctic_rl_verl/cpu_platform.py).
export VERL_PLATFORM=cpu
# The reward workers import recipes.txt2sql.reward.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-$OUT/metrics.jsonl}"

exec python -m verl.trainer.main_ppo --config-path "$HERE" --config-name arctic_txt2sql \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/dev.parquet" \
    trainer.default_local_dir="$OUT/checkpoints" hydra.run.dir="$OUT/hydra" "$@"
