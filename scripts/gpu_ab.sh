#!/usr/bin/env bash
# A/B timing on the GPU machine: the working tree against another revision, one after the other in one call
# (timings are comparable only within one call, on one card).
#
#   here:        bash scripts/gpu_ab.sh prepare REV
#                    # ab/base/ gets REV's arctic_rl_core and benchmarks. ab/ is untracked and not ignored, so the
#                    # device's copy of the working tree carries it; remove it before committing.
#   the device:  source .whl/setup.sh && bash scripts/gpu_ab.sh run python3 benchmarks/fca.py --skip-kernels
#                    # the command from ab/base, then from the tree; both outputs, labelled, in $OUT/ab.log
#                    # (else ./gpu-out/ab.log)
set -uo pipefail

case "${1:-}" in
  prepare)
    rev=${2:?usage: bash scripts/gpu_ab.sh prepare REV}
    rm -rf ab/base && mkdir -p ab/base
    git archive "$rev" arctic_rl_core benchmarks | tar -x -C ab/base || exit 1
    echo "ab/base: $(git log -1 --format='%h %s' "$rev")"
    echo "ab/ travels with the working tree to the device; remove it before committing"
    ;;
  run)
    shift
    [ $# -gt 0 ] || { echo "usage: bash scripts/gpu_ab.sh run COMMAND..." >&2; exit 2; }
    [ -d ab/base/arctic_rl_core ] || { echo "no ab/base: run 'bash scripts/gpu_ab.sh prepare REV' here first" >&2; exit 2; }
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    # Each side imports its own arctic_rl_core: its folder comes first on the path (.whl/setup.sh's follows).
    for dir in "$PWD/ab/base" "$PWD"; do
      echo "== $dir" | tee -a "$out/ab.log"
      (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} "$@") 2>&1 | tee -a "$out/ab.log"
    done
    ;;
  *)
    echo "usage: bash scripts/gpu_ab.sh prepare REV | run COMMAND..." >&2
    exit 2
    ;;
esac
