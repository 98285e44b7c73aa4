#!/usr/bin/env bash
# Run the test suite on CPU: installs what it needs first (scripts/setup_env.sh), then pytest.
#   bash scripts/test.sh                  # everything CI runs
#   bash scripts/test.sh tests/unit -x    # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/arctic-rl/torch_extensions_py311}
export VLLM_TARGET_DEVICE=cpu RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
venv=${ARCTIC_RL_VENV:-.venv}
exec "$venv/bin/python" -m pytest -q "${@:-tests}"
