#!/usr/bin/env bash
# GSM8K GRPO with TRL on one GPU: ArcticGRPOTrainer, Qwen3-1.7B, training and sampling colocated
# (gsm8k_grpo.yaml).
#
#   recipes/gsm8k/trl/run.sh [hydra overrides...]
#
# Examples of overrides:
#   model=/models/Qwen3-1.7B                                    (a local copy of the weights)
#   arctic.colocate=false                                       (2 GPUs: one trains, one samples)
#   trainer=trl                                                 (TRL's own GRPOTrainer, for comparison)
#   resume_from_checkpoint=runs/gsm8k-trl/checkpoint-100
# DATA (default ~/data/gsm8k) holds train.parquet and test.parquet; they are made from the hub when missing.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
DATA="${DATA:-$HOME/data/gsm8k}"

cd "$REPO"
if [ ! -f "$DATA/train.parquet" ]; then
    python -m recipes.gsm8k.data --out "$DATA"
fi

exec python -m recipes.trl_main --config-path "$HERE" --config-name arctic_gsm8k \
    data.train_files="$DATA/train.parquet" data.eval_files="$DATA/test.parquet" "$@"
