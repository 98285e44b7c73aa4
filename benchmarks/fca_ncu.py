"""One FCA case's kernels launched eagerly a few times, for Nsight Compute to read their hardware counters.

    ncu --clock-control none -k regex:'_attend_items|_merge_partials' --launch-skip 4 --launch-count 2 \
        --set full -o fca python3 benchmarks/fca_ncu.py --case 4x16 --rows 64

(``bash scripts/gpu_check.sh ncu`` runs it for the cases and tile shapes that matter and prints the
reports.) Timing belongs to ``fca.py`` and ``fca_sweep.py``: ncu serializes launches and replays each
kernel once per counter pass, so only its counters, not its durations, are worth comparing here.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from fca import DIM, HEADS, KV_HEADS, SCALE, paged_batch

from arctic_rl_core.zorro.attention import triton_attention as kernel
from arctic_rl_core.zorro.attention.forest import build_forest
from arctic_rl_core.zorro.attention.plan import ROWS_128, TileShape, plan_decode

CASES = {"4x16": (4, 16), "1x16": (1, 16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, default="4x16")
    parser.add_argument("--rows", type=int, choices=(64, 128), default=64, help="wide tile rows (128: plan.ROWS_128)")
    parser.add_argument("--launches", type=int, default=4, help="launches of each kernel after the warm-up")
    args = parser.parse_args()

    tiles = TileShape(HEADS // KV_HEADS)
    if args.rows == 128:
        tiles = dataclasses.replace(tiles, **ROWS_128)
    batch = paged_batch(*CASES[args.case], 8192, 256)
    forest = build_forest(batch["tables"], batch["lengths"], 16)
    target = 4 * torch.cuda.get_device_properties(0).multi_processor_count // KV_HEADS  # as the engine
    plan = plan_decode(forest, batch["lengths"], tiles, target)
    device_plan = kernel.DevicePlan.from_plan(plan, "cuda")
    workspace = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
    out = torch.empty_like(batch["q"])
    for i in range(4 + args.launches):  # the first 4 compile and warm up (ncu's --launch-skip 4)
        k_cache, v_cache = batch["caches"][i % len(batch["caches"])]
        kernel.paged_attention(batch["q"], k_cache, v_cache, batch["block_tables"], batch["positions"], device_plan,
                               workspace, SCALE, tiles, out=out)  # fmt: skip
    torch.cuda.synchronize()
    build = next(iter(kernel.BUILDS.values()))
    print(f"{args.case} rows {args.rows}: items {len(plan.wide_items)}+{len(plan.narrow_items)}, "
          f"{plan.num_partial_rows} partial rows, {build}")  # fmt: skip


if __name__ == "__main__":
    main()
