#!/usr/bin/env bash
# GSM8K GRPO on GPUs: verl 0.9.1's trainer, arctic-rl's engines (Qwen3-1.7B, one node of 8 GPUs).
#
#   recipes/gsm8k/verl/run.sh [hydra overrides...]
#
# The run is gsm8k_grpo.yaml. Examples of overrides:
#   actor_rollout_ref.model.path=/models/Qwen3-1.7B                  (a local copy of the weights)
#   actor_rollout_ref.actor.arctic.training_gpus=4 actor_rollout_ref.actor.arctic.sampling_gpus=4 \
#   actor_rollout_ref.actor.arctic.log_prob_gpus=4                    (a node of 4 GPUs)
#   actor_rollout_ref.actor.arctic.sampling_engine=native             (arctic's own sampler instead of vLLM)
#   actor_rollout_ref.actor.arctic.zorro_train=false                  (ZoRRo Train off)
# DATA (default ~/data/gsm8k) holds train.parquet and test.parquet; they are made from the hub when missing.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
# Checkpoints, Hydra's outputs and (with trainer.logger including file) metrics.jsonl; the default is
# runs/gsm8k-verl in the repository (git-ignored), never the bare relative paths verl's config names.
OUT="${OUT:-$REPO/runs/gsm8k-verl}"
DATA="${DATA:-$HOME/data/gsm8k}"

cd "$REPO"
if [ ! -f "$DATA/train.parquet" ]; then
    python -m recipes.gsm8k.data --out "$DATA"
fi

# verl's processes hold no GPU: arctic-rl places all the compute (integrations/arctic_rl_verl/cpu_platform.py).
export VERL_PLATFORM=cpu
# The reward workers import recipes.gsm8k.reward.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-$OUT/metrics.jsonl}"

exec python -m verl.trainer.main_ppo --config-path "$HERE" --config-name arctic_gsm8k \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    trainer.default_local_dir="$OUT/checkpoints" hydra.run.dir="$OUT/hydra" "$@"
