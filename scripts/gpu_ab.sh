#!/usr/bin/env bash
# A/B timing on the GPU machine: the working tree against other revisions, one after the other in one call
# (timings are comparable only within one call, on one card).
#
#   here:        bash scripts/gpu_ab.sh prepare REV [REV...]
#                    # ab/<n>-<rev>/ gets each REV's arctic_rl_core and benchmarks. ab/ is untracked and not
#                    # ignored, so the device's copy of the working tree carries it; remove it before committing.
#   the device:  source .whl/setup.sh && bash scripts/gpu_ab.sh run python3 benchmarks/fca.py --skip-kernels
#                    # the command from each prepared revision in the order given, then from the tree; every
#                    # output, labelled, in $OUT/ab.log (else ./gpu-out/ab.log)
set -uo pipefail

case "${1:-}" in
  prepare)
    shift
    [ $# -gt 0 ] || { echo "usage: bash scripts/gpu_ab.sh prepare REV [REV...]" >&2; exit 2; }
    rm -rf ab && mkdir -p ab
    n=0
    for rev in "$@"; do
      n=$((n + 1))
      dir="ab/$n-$(git rev-parse --short "$rev")" || exit 1
      mkdir -p "$dir"
      git archive "$rev" arctic_rl_core benchmarks | tar -x -C "$dir" || exit 1
      echo "$dir: $(git log -1 --format='%h %s' "$rev")"
    done
    echo "ab/ travels with the working tree to the device; remove it before committing"
    ;;
  run)
    shift
    [ $# -gt 0 ] || { echo "usage: bash scripts/gpu_ab.sh run COMMAND..." >&2; exit 2; }
    bases=$(ls -d ab/[0-9]*-* 2>/dev/null | sort -t/ -k2 -n)
    [ -n "$bases" ] || { echo "nothing in ab/: run 'bash scripts/gpu_ab.sh prepare REV' here first" >&2; exit 2; }
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    # Each side imports its own arctic_rl_core: its folder comes first on the path (.whl/setup.sh's follows).
    for dir in $bases "$PWD"; do
      dir=$(cd "$dir" && pwd)
      echo "== $dir" | tee -a "$out/ab.log"
      (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} "$@") 2>&1 | tee -a "$out/ab.log"
    done
    ;;
  *)
    echo "usage: bash scripts/gpu_ab.sh prepare REV [REV...] | run COMMAND..." >&2
    exit 2
    ;;
esac
