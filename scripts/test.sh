#!/usr/bin/env bash
# Run the test suite on CPU: installs what it needs first (scripts/setup_env.sh), then pytest.
#   bash scripts/test.sh                  # everything CI runs, SkyRL's Python 3.12 suite included
#   bash scripts/test.sh tests/unit -x    # any pytest arguments (main environment only)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/arctic-rl/torch_extensions_py311}
export VLLM_TARGET_DEVICE=cpu RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
venv=${ARCTIC_RL_VENV:-.venv}
if [ $# -gt 0 ]; then
  exec "$venv/bin/python" -m pytest -q "$@"
fi
# SkyRL 0.4 needs Python 3.12 and an environment of its own. Building it is mostly downloading,
# so it runs while the main suite keeps the CPUs busy.
skyrl_log=$(mktemp)
bash integrations/arctic_rl_skyrl/install_env.sh >"$skyrl_log" 2>&1 &
skyrl_install=$!
status=0
"$venv/bin/python" -m pytest -q tests || status=$?
if ! wait "$skyrl_install"; then
  cat "$skyrl_log"
  echo "SkyRL environment install failed" >&2
  exit 1
fi
tail -n 3 "$skyrl_log"
skyrl_venv=${ARCTIC_RL_SKYRL_VENV:-.venv-skyrl}
TORCH_EXTENSIONS_DIR=$HOME/.cache/arctic-rl/torch_extensions_py312 "$skyrl_venv/bin/python" -m pytest -q tests/skyrl || status=$?
exit $status
