#!/usr/bin/env bash
# Build the Python 3.12 environment of the SkyRL integration: skyrl[skyrl-train] 0.4.0, its pinned
# dependencies (requirements-skyrl.lock), and arctic-rl installed editable from this checkout.
#
#   bash integrations/arctic_rl_skyrl/install_env.sh [VENV_DIR]      # default: <repo>/.venv-skyrl
#
# Idempotent: a venv whose stamp matches the lock, this script and pyproject.toml is left as it is.
# Every wheel (torch's CUDA build included: PyPI has no CPU-only torch for Linux) is kept in a
# wheelhouse, $ARCTIC_RL_SKYRL_CACHE (default ~/.cache/arctic-rl-skyrl), so a rebuild downloads
# nothing. Sdists without wheels (deepspeed, flash-attn, ...) are built once into that wheelhouse;
# flash-attn is built without its CUDA kernels, which arctic-rl never imports.
#
# Python 3.12 comes from $PYTHON312, else `python3.12` on PATH, else pyenv.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$repo/integrations/arctic_rl_skyrl"
lock="$here/requirements-skyrl.lock"
venv="${1:-${ARCTIC_RL_SKYRL_VENV:-$repo/.venv-skyrl}}"
cache="${ARCTIC_RL_SKYRL_CACHE:-$HOME/.cache/arctic-rl-skyrl}"
wheels="$cache/wheels"
started=$SECONDS

step() { printf '[install_env %4ds] %s\n' "$((SECONDS - started))" "$*"; }

find_python312() {
    local candidate
    for candidate in "${PYTHON312:-}" "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if [[ -n "$candidate" && -x "$candidate" ]] && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            echo "$candidate"
            return
        fi
    done
    echo "install_env.sh: no Python 3.12 found; set PYTHON312=/path/to/python3.12" >&2
    exit 1
}

stamp="$(cat "$lock" "$here/install_env.sh" "$repo/pyproject.toml" | sha256sum | cut -c1-16)"
stamp_file="$venv/.arctic-rl-skyrl-stamp"
check='import skyrl.train.entrypoints.main_base, arctic_rl_core, arctic_rl_skyrl; print(arctic_rl_core.__file__)'
if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
    if installed="$("$venv/bin/python" -c "$check" 2>/dev/null | tail -1)"; then
        # A venv kept across checkouts (ARCTIC_RL_SKYRL_VENV) must import arctic-rl from this one.
        if [[ "$installed" != "$repo/"* ]]; then
            step "pointing the editable arctic-rl install at $repo"
            "$venv/bin/python" -m pip --disable-pip-version-check install --quiet --no-deps --no-build-isolation -e "$repo"
        fi
        step "up to date: $venv (stamp $stamp)"
        exit 0
    fi
fi

python312="$(find_python312)"
mkdir -p "$wheels"
if [[ ! -x "$venv/bin/python" ]]; then
    step "creating $venv with $python312"
    "$python312" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
pin() { grep -iE "^$1==" "$lock"; }

# torch and the build tools first: deepspeed's and flash-attn's setup.py import torch.
build_tools=("$(pin torch)" "$(pin setuptools)" "$(pin ninja)" "$(pin psutil)" "$(pin packaging)" "$(pin numpy)")
if ! "${pip[@]}" install --quiet --no-index --find-links "$wheels" "${build_tools[@]}" 2>/dev/null; then
    step "downloading torch (a CUDA build, ~2.6 GB with its nvidia wheels) and build tools into $wheels"
    "${pip[@]}" download --quiet --only-binary=:all: -d "$wheels" "${build_tools[@]}"
    "${pip[@]}" install --quiet --no-index --find-links "$wheels" "${build_tools[@]}"
fi
step "torch installed"

wheelhouse_stamp="$wheels/.complete-$(sha256sum "$lock" | cut -c1-16)"
if [[ ! -f "$wheelhouse_stamp" ]]; then
    step "filling the wheelhouse from $lock (building sdists once)"
    FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
        "${pip[@]}" wheel --quiet --no-deps --no-build-isolation --find-links "$wheels" -w "$wheels" -r "$lock"
    touch "$wheelhouse_stamp"
fi

step "installing the locked environment"
"${pip[@]}" install --quiet --no-index --find-links "$wheels" --no-deps -r "$lock"
"${pip[@]}" install --quiet --no-deps --no-build-isolation -e "$repo"
"$venv/bin/python" -c "$check" >/dev/null 2>&1
echo "$stamp" > "$stamp_file"
step "done: $venv ($(du -sh "$venv" | cut -f1)); wheelhouse $wheels ($(du -sh "$wheels" | cut -f1))"
