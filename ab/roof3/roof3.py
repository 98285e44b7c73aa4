"""Which decode plan shape reads fastest, with no math? Read-only (ab/roof2's read_items) over plan_decode's items
for tile rows 64/128, chunk_per_row 1/2/4, targets x1/x2, at 64- and 128-key steps and 264/528 persistent programs;
plus the read floor. python3 ab/roof3/roof3.py
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "ab" / "roof2")]
from fca import BLOCK, DIM, HEADS, KV_HEADS, graph_us, paged_batch  # noqa: E402
from fca_floor import read_floor_us  # noqa: E402
from roof2 import read_items  # noqa: E402

from arctic_rl_core.zorro.attention.forest import build_forest  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape, plan_decode  # noqa: E402


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name())
    for label, groups, per_group in (("4x16", 4, 16), ("1x16", 1, 16)):
        batch = paged_batch(groups, per_group, 8192, 256)
        caches, tables = batch["caches"], batch["block_tables"]
        sums = torch.empty(1 << 16, DIM, device="cuda")
        forest = build_forest(batch["tables"], batch["lengths"], BLOCK)
        print(f"[{label}] floor {read_floor_us(batch, groups, per_group, 8192, 256, graph_us):5.1f} us")
        for rows in (64, 128):
            for per_row in (1, 2, 4):
                for factor in (1, 2):
                    tiles = TileShape(HEADS // KV_HEADS, wide_rows=rows, chunk_per_row=per_row)
                    for programs in (2 * sms, 4 * sms):
                        plan = plan_decode(forest, batch["lengths"], tiles, factor * 4 * sms // KV_HEADS,
                                           lanes=programs // KV_HEADS)
                        items = torch.from_numpy(
                            __import__("numpy").concatenate([plan.wide_items, plan.narrow_items])).cuda()
                        for block_n in (64, 128):
                            def run(layer, grid=programs, block_n=block_n, items=items):
                                k, v = caches[layer]
                                read_items[(grid,)](k, v, tables, items, len(items), sums, *k.stride()[:3],
                                                    tables.stride(0), NUM_KV_HEADS=KV_HEADS, HEAD_DIM=DIM,
                                                    BLOCK_SIZE=BLOCK, BLOCK_N=block_n, num_warps=4)
                            print(f"  rows {rows:3d} cpr {per_row} x{factor} {programs} programs bn {block_n:3d}: "
                                  f"{len(plan.wide_items)}+{len(plan.narrow_items)} items  {graph_us(run):5.1f} us")


if __name__ == "__main__":
    main()
