"""Where does FCA's time over the read floor go? Read-only kernels over (a) fca_floor's ranges, (b) the same with each
prefix read twice (64-row tiles: two tiles per group of 16), (c) FCA's own balanced plan items, persistent at FCA's
program count and one program per unit; against FCA itself, in one run."""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from fca import BLOCK, DIM, HEADS, KV_HEADS, SCALE, graph_us, paged_batch  # noqa: E402
from fca_floor import _read_ranges, fca_ranges  # noqa: E402

from arctic_rl_core.zorro.attention import triton_attention as kernel  # noqa: E402
from arctic_rl_core.zorro.attention.forest import build_forest  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape, plan_decode  # noqa: E402


@triton.jit
def read_items(K, V, TABLES, ITEMS, num_items, SUMS, stride_kb, stride_ks, stride_kh, stride_bt,
               NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM)
    total = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for work in range(tl.program_id(0), num_items * NUM_KV_HEADS, tl.num_programs(0)):
        item = ITEMS + (work // NUM_KV_HEADS) * 6
        kv_head = work % NUM_KV_HEADS
        table = TABLES + tl.load(item + 2).to(tl.int64) * stride_bt
        start, end = tl.load(item + 3), tl.load(item + 4)
        for offset in tl.range(start, end, BLOCK_N, num_stages=3):
            pos = offset + tl.arange(0, BLOCK_N)
            valid = pos < end
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            at = (block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh)[:, None] + dims[None, :]
            total += tl.sum(tl.load(K + at, mask=valid[:, None], other=0.0).to(tl.float32)
                            + tl.load(V + at, mask=valid[:, None], other=0.0).to(tl.float32), axis=0)
    tl.store(SUMS + tl.program_id(0) * HEAD_DIM + dims, total)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name())
    for label, groups, per_group in (("4x16", 4, 16), ("1x16", 1, 16)):
        batch = paged_batch(groups, per_group, 8192, 256)
        caches, q, tables, positions = batch["caches"], batch["q"], batch["block_tables"], batch["positions"]
        sums = torch.empty(1 << 16, DIM, device="cuda")
        tiles = TileShape(HEADS // KV_HEADS)
        forest = build_forest(batch["tables"], batch["lengths"], BLOCK)
        target = 4 * sms // KV_HEADS
        plan = plan_decode(forest, batch["lengths"], tiles, target)
        dp = kernel.DevicePlan.from_plan(plan, "cuda")
        ws = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
        out = torch.empty_like(q)
        kernel.paged_attention(q, *caches[0], tables, positions, dp, ws, SCALE, tiles, out=out, decode=True)
        lanes = kernel.plan_lanes(HEADS, *caches[0], tiles, torch.bfloat16)
        plan = plan_decode(forest, batch["lengths"], tiles, target, lanes=lanes)
        dp = kernel.DevicePlan.from_plan(plan, "cuda")
        ws = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
        programs = lanes * KV_HEADS
        t_fca = graph_us(lambda l: kernel.paged_attention(q, *caches[l], tables, positions, dp, ws, SCALE, tiles,
                                                          out=out, decode=True))
        t_attend = graph_us(lambda l: kernel.paged_attention(q, *caches[l], tables, positions, dp, ws, SCALE, tiles,
                                                             merge=False, out=out, decode=True))
        print(f"[{label}] FCA {t_fca:5.1f} us, attention launch alone {t_attend:5.1f}; plan "
              f"{len(plan.wide_items)}+{len(plan.narrow_items)} items, {programs} programs")

        def ranges_run(ranges, block_n=128):
            def run(l):
                k, v = caches[l]
                _read_ranges[(len(ranges) * KV_HEADS,)](k, v, tables, ranges, sums, *k.stride()[:3], tables.stride(0),
                                                       NUM_KV_HEADS=KV_HEADS, HEAD_DIM=DIM, BLOCK_SIZE=BLOCK,
                                                       BLOCK_N=block_n, num_warps=4)
            return run

        for chunk in (256, 512):
            once = fca_ranges(groups, per_group, 8192, 256, chunk, "cuda")
            prefix_rows = once[:groups * 8192 // chunk]
            twice = torch.cat([prefix_rows, prefix_rows, once[groups * 8192 // chunk:]])
            # the second read right after the first, as the two tiles of a group run side by side
            twice_adjacent = torch.cat([prefix_rows.repeat_interleave(2, 0), once[groups * 8192 // chunk:]])
            print(f"  floor chunk {chunk}: once {graph_us(ranges_run(once)):5.1f} | prefix twice, a pass apart "
                  f"{graph_us(ranges_run(twice)):5.1f} | prefix twice, side by side "
                  f"{graph_us(ranges_run(twice_adjacent)):5.1f} | prefix only {graph_us(ranges_run(prefix_rows)):5.1f}"
                  f" | suffixes only {graph_us(ranges_run(once[groups * 8192 // chunk:])):5.1f} us")
        items = torch.cat([dp.wide_items[:len(plan.wide_items)], dp.narrow_items[:len(plan.narrow_items)]])
        units = len(items) * KV_HEADS
        for grid, block_n in ((programs, 64), (programs, 128), (units, 64), (units, 128)):
            def run(l, grid=grid, block_n=block_n):
                k, v = caches[l]
                read_items[(grid,)](k, v, tables, items, len(items), sums, *k.stride()[:3], tables.stride(0),
                                    NUM_KV_HEADS=KV_HEADS, HEAD_DIM=DIM, BLOCK_SIZE=BLOCK, BLOCK_N=block_n,
                                    num_warps=4)
            print(f"  read FCA's plan items (each wide item once per tile), {grid} programs, BLOCK_N {block_n}: "
                  f"{graph_us(run):5.1f} us")


if __name__ == "__main__":
    main()
