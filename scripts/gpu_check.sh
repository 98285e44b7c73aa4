#!/usr/bin/env bash
# The GPU machine's checks, in calls of at most 10 minutes each; every log lands in $OUT (else ./gpu-out).
#
#   bash scripts/gpu_check.sh tests     # tests/gpu in three processes: kernels, engine, sync (~8 min in all);
#                                       # `tests kernels|engine|sync` runs one of them
#   bash scripts/gpu_check.sh bench     # sampling.py, fca.py, fca_sweep.py --quick (~8 min)
#   bash scripts/gpu_check.sh profile   # decode_profile.py, decode_linear.py --chain-only, fca_sweep.py
#   bash scripts/gpu_check.sh changed   # what the last session changed (the read floor): fca_floor.py's
#                                       # tilings, fca.py at Qwen2.5-7B's attention, then fca.py
#   bash scripts/gpu_check.sh ncu       # Nsight Compute's counters for the FCA kernels (4x16 and 1x16, 64- and
#                                       # 128-row tiles): ncu-*.txt details, ncu-*-sass.csv stall samples per
#                                       # instruction; then fca.py
#   bash scripts/gpu_check.sh tiles     # the projection chain with other tiles (decode_linear.py --chain-sweep),
#                                       # the end to end with the tiles it found, then what the FCA suffix units
#                                       # cost (fca_sweep.py --suffixes) (~8 min)
#   bash scripts/gpu_check.sh short     # for a call with little device time left (~5 min): what each projection
#                                       # adds to the decoder's chain (decode_linear.py --chain-parts), then the
#                                       # kernels part of tests/gpu
#   bash scripts/gpu_check.sh fingerprint  # the code fingerprint summary.txt records, for this tree
#
# On the device machine, from the project root: `source .whl/setup.sh && bash scripts/gpu_check.sh tests`.
# With ONLY_ON=H200 (any part of the card's name) it runs only on that card and exits at once elsewhere.
# Each step has its own time limit, so one slow step still leaves the others' logs; summary.txt lists
# every step's exit code and seconds.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  printf '%-22s rc %3d  %4d s  %s\n' "$name" "$rc" "$((SECONDS - start))" "$*" | tee -a "$out/summary.txt"
}

# -v: each test's name and result is in the log as it ends, so a step cut by its limit still says what failed.
pytest_step() {  # pytest_step NAME LIMIT_S PYTEST_ARGS...
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" python3 -m pytest -v -p no:cacheprovider --tb=short -rfEs "$@" --junitxml="$out/$name.xml"
}

# The device's copy of .git may lag the working tree it runs, so the code itself is fingerprinted too:
# `bash scripts/gpu_check.sh fingerprint` here prints the same line for a local tree.
fingerprint() { echo "code $(find arctic_rl_core benchmarks tests/gpu -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)"; }
if [ "${1:-}" = fingerprint ]; then fingerprint; exit 0; fi

# ONLY_ON=H200: run nothing unless the card's name contains it. A request for one kind of card may be given
# another, and figures from the wrong card are device time spent for nothing; this stops within seconds.
if [ -n "${ONLY_ON:-}" ]; then
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  if [[ "$card" != *"$ONLY_ON"* ]]; then
    echo "ONLY_ON=$ONLY_ON, but this card is ${card:-unknown}: nothing run"
    exit 0
  fi
fi

{ date -u; git log -1 --format='%h %s' 2>/dev/null; fingerprint; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm \
  --format=csv 2>&1; } >"$out/summary.txt"

# tests/gpu in three parts, each in its own process: a crash or a hang in one leaves the others' results.
declare -A parts=(
  [kernels]="tests/gpu/test_batched_copy_gpu.py tests/gpu/test_cuda_graphs_training_gpu.py
    tests/gpu/test_decode_linear_gpu.py tests/gpu/test_fca_kernel.py tests/gpu/test_layer_graphs_gpu.py
    tests/gpu/test_softmax_statistics_gpu.py"
  [engine]="tests/gpu/test_native_engine_gpu.py tests/gpu/test_sleep_file_sync_gpu.py
    tests/gpu/test_sleep_modes_gpu.py"
  [sync]="tests/gpu/test_weight_sync_cuda_ipc_gpu.py tests/gpu/test_weight_sync_coordinator_nccl.py
    tests/gpu/test_zorro_train_gpu.py"
)
tests_part() {  # tests_part PART
  for file in tests/gpu/test_*.py; do  # a new test file must join a part, or it would never run here
    [[ " ${parts[*]} " =~ [[:space:]]$file[[:space:]] ]] || { echo "$file is in no tests part" >&2; exit 2; }
  done
  [ -n "${parts[$1]:-}" ] || { echo "unknown tests part $1: expected kernels, engine or sync" >&2; exit 2; }
  # shellcheck disable=SC2086  # the part's files are separate words
  pytest_step "gpu-tests-$1" 300 ${parts[$1]}
}

case "${1:-}" in
  tests)
    for part in ${2:-kernels engine sync}; do
      tests_part "$part"
    done
    ;;
  bench)
    step sampling 170 python3 benchmarks/sampling.py
    step fca 230 python3 benchmarks/fca.py
    step fca-sweep-quick 150 python3 benchmarks/fca_sweep.py --quick
    ;;
  profile)
    step decode-profile 150 python3 benchmarks/decode_profile.py
    step decode-linear-chain 120 python3 benchmarks/decode_linear.py --chain-only
    step decode-linear-parts 80 python3 benchmarks/decode_linear.py --chain-parts
    step fca-sweep 300 python3 benchmarks/fca_sweep.py
    ;;
  changed)
    step fca-floor 120 python3 benchmarks/fca_floor.py
    step fca-qwen2.5-7b 120 python3 benchmarks/fca.py --skip-e2e --shape qwen2.5-7b
    step fca 150 python3 benchmarks/fca.py
    ;;
  tiles)
    step chain-sweep 200 python3 benchmarks/decode_linear.py --chain-sweep --sweep-json "$out/tiles.json"
    step e2e-linear-tiles 230 python3 benchmarks/fca.py --skip-kernels --linear-tiles "$out/tiles.json"
    step fca-suffixes 60 python3 benchmarks/fca_sweep.py --suffixes
    ;;
  short)
    step chain-parts 80 python3 benchmarks/decode_linear.py --chain-parts
    tests_part kernels
    ;;
  ncu)
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
    for case in 4x16 1x16; do
      for rows in 64 128; do
        name=ncu-$case-$rows
        # fca_ncu.py warms up with 4 launches of each kernel: skip those 8, then one attend and one merge.
        step "$name" 90 "$ncu" --clock-control none -k 'regex:_attend_items|_merge_partials' --launch-skip 8 \
          --launch-count 2 --set full --import-source yes -f -o "$out/$name" \
          python3 benchmarks/fca_ncu.py --case "$case" --rows "$rows"
        "$ncu" -i "$out/$name.ncu-rep" --page details >"$out/$name.txt" 2>&1
        "$ncu" -i "$out/$name.ncu-rep" --page source --csv --print-source sass -k _attend_items \
          >"$out/$name-sass.csv" 2>&1
      done
    done
    step fca 130 python3 benchmarks/fca.py
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh tests [kernels|engine|sync]|bench|profile|changed|tiles|short|ncu|fingerprint" >&2
    exit 2
    ;;
esac
cat "$out/summary.txt"
