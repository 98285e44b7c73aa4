#!/usr/bin/env bash
# Long-context QA GRPO with TRL on GPUs: ArcticGRPOTrainer, ZoRRo on, Qwen3-8B on HotpotQA, one node of
# 8 GPUs (long_context_qa_grpo.yaml).
#
#   recipes/long_context_qa/trl/run.sh [hydra overrides...]
#
# Examples of overrides:
#   model=/models/Qwen3-8B                                             (a local copy of the weights)
#   arctic.training_config.zorro_train.enable=false                    (ZoRRo Train off, to compare)
#   +reward.kwargs.metric=em                                           (exact match instead of F1)
#   trainer=trl                                                        (TRL's own GRPOTrainer, for comparison)
# DATA (default ~/data/hotpotqa) holds train.parquet and test.parquet; they are made from the hub
# (hotpotqa/hotpot_qa, distractor) when missing.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
DATA="${DATA:-$HOME/data/hotpotqa}"

cd "$REPO"
if [ ! -f "$DATA/train.parquet" ]; then
    python -m recipes.long_context_qa.data --out "$DATA" --dataset hotpotqa
fi

exec python -m recipes.trl_main --config-path "$HERE" --config-name arctic_long_context_qa \
    data.train_files="$DATA/train.parquet" data.eval_files="$DATA/test.parquet" "$@"
