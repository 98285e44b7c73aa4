#!/usr/bin/env bash
# Long-context QA GRPO on GPUs: verl 0.9.1's trainer, arctic-rl's engines, ZoRRo on (Qwen3-8B on
# HotpotQA, one node of 8 GPUs).
#
#   recipes/long_context_qa/verl/run.sh [hydra overrides...]
#
# The run is long_context_qa_grpo.yaml. Examples of overrides:
#   actor_rollout_ref.model.path=/models/Qwen3-8B                    (a local copy of the weights)
#   actor_rollout_ref.actor.arctic.zorro_train=false                  (ZoRRo Train off, to compare)
#   +reward.custom_reward_function.reward_kwargs.metric=em            (exact match instead of F1)
# DATA (default ~/data/hotpotqa) holds train.parquet and test.parquet; they are made from the hub
# (hotpotqa/hotpot_qa, distractor) when missing. For MuSiQue or synthetic contexts, prepare the data
# with python -m recipes.long_context_qa.data and point DATA at it (see the recipe README).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
# Checkpoints, Hydra's outputs and (with trainer.logger including file) metrics.jsonl; the default is
# runs/long_context_qa-verl in the repository (git-ignored), never the bare relative paths verl's config names.
OUT="${OUT:-$REPO/runs/long_context_qa-verl}"
DATA="${DATA:-$HOME/data/hotpotqa}"

cd "$REPO"
if [ ! -f "$DATA/train.parquet" ]; then
    python -m recipes.long_context_qa.data --out "$DATA" --dataset hotpotqa
fi

# verl's processes hold no GPU: arctic-rl places all the compute (integrations/arctic_rl_verl/cpu_platform.py).
export VERL_PLATFORM=cpu
# The reward workers import recipes.long_context_qa.reward.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-$OUT/metrics.jsonl}"

exec python -m verl.trainer.main_ppo --config-path "$HERE" --config-name arctic_long_context_qa \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    trainer.default_local_dir="$OUT/checkpoints" hydra.run.dir="$OUT/hydra" "$@"
