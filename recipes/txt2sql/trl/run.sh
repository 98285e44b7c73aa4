#!/usr/bin/env bash
# Txt2SQL GRPO with TRL on GPUs: ArcticGRPOTrainer, Qwen3-8B on Spider, one node of 8 GPUs (txt2sql_grpo.yaml).
#
#   SPIDER=~/spider_data recipes/txt2sql/trl/run.sh [hydra overrides...]
#
# Examples of overrides:
#   model=/models/Qwen3-8B                                             (a local copy of the weights)
#   arctic.training_gpus=4 arctic.sampling_gpus=4                      (a node of 4 GPUs)
#   trainer=trl                                                        (TRL's own GRPOTrainer, for comparison)
#   resume_from_checkpoint=runs/txt2sql-trl/checkpoint-100
# DATA (default ~/data/spider) receives train.parquet and dev.parquet, made from the Spider release
# in SPIDER when missing (https://yale-lily.github.io/spider).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
DATA="${DATA:-$HOME/data/spider}"

cd "$REPO"
if [ ! -f "$DATA/train.parquet" ]; then
    python -m recipes.txt2sql.data --out "$DATA" --source spider \
        --root "${SPIDER:?set SPIDER to the unzipped Spider release}"
fi

exec python -m recipes.trl_main --config-path "$HERE" --config-name arctic_txt2sql \
    data.train_files="$DATA/train.parquet" data.eval_files="$DATA/dev.parquet" "$@"
