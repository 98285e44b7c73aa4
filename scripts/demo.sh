#!/usr/bin/env bash
# The main job: install if needed, then train a tiny model with GRPO through the arctic-rl client on CPU.
#   bash scripts/demo.sh                  # writes runs/demo/reward_curve.png
#   bash scripts/demo.sh --steps 40       # any arguments of python -m arctic_rl_core.demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/arctic-rl/torch_extensions_py311}
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
venv=${ARCTIC_RL_VENV:-.venv}
exec "$venv/bin/python" -m arctic_rl_core.demo "$@"
