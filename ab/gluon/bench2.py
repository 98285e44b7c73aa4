"""PROTOTYPE driver 2: Gluon wide tiles (64 rows / 4 warps, 128 rows / 8 warps) vs the Triton kernel, parts timed apart.

    (device, repo root, this folder at ab/gluon) source .whl/setup.sh && python3 ab/gluon/bench2.py
"""

import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).parent)]

from fca import BLOCK, DIM, HEADS, KV_HEADS, SCALE, graph_us, paged_batch  # noqa: E402
from wide_decode import attend_wide_decode  # noqa: E402
from fca_floor import _read_ranges, fca_ranges  # noqa: E402

from arctic_rl_core.zorro.attention import triton_attention as kernel  # noqa: E402
from arctic_rl_core.zorro.attention.forest import build_forest  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape, plan_decode  # noqa: E402
from arctic_rl_core.zorro.attention.reference import paged_decode_attention  # noqa: E402

GROUP = HEADS // KV_HEADS
# (tile rows, ring stages, plan target factor, chunk_per_row)
VARIANTS = ((128, 3, 2, 2), (64, 3, 2, 4))
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def plans(batch, tiles, target, lanes):
    plan = plan_decode(build_forest(batch["tables"], batch["lengths"], BLOCK), batch["lengths"], tiles, target,
                       lanes=lanes)
    full = kernel.DevicePlan.from_plan(plan, "cuda")
    wide_only = kernel.DevicePlan.from_plan(plan, "cuda")
    wide_only.counts[1] = 0
    narrow_only = kernel.DevicePlan.from_plan(plan, "cuda")
    narrow_only.counts[0] = 0
    empty = kernel.DevicePlan.from_plan(plan, "cuda")
    empty.counts.zero_()
    return plan, full, wide_only, narrow_only, empty


def case(groups, per_group, stages_note=""):
    batch = paged_batch(groups, per_group, 8192, 256)
    caches, q, tables, positions = batch["caches"], batch["q"], batch["block_tables"], batch["positions"]
    expected = paged_decode_attention(q.float(), caches[0][0].float(), caches[0][1].float(), tables,
                                      batch["lengths"], SCALE)
    target = 4 * SMS // KV_HEADS

    # Triton, as the engine runs it (balanced over its lanes).
    tiles = TileShape(GROUP)
    plan, full, wide_only, narrow_only, empty = plans(batch, tiles, target, None)
    ws = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
    out_t = torch.empty_like(q)
    kernel.paged_attention(q, *caches[0], tables, positions, full, ws, SCALE, tiles, out=out_t, decode=True)
    lanes = kernel.plan_lanes(HEADS, *caches[0], tiles, torch.bfloat16)
    plan, full, wide_only, narrow_only, empty = plans(batch, tiles, target, lanes)
    ws = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)

    def triton(dp, wide=True, merge=True):
        return lambda layer: kernel.paged_attention(q, *caches[layer], tables, positions, dp, ws, SCALE, tiles,
                                                    wide=wide, merge=merge, out=out_t, decode=True)

    triton(full)(0)
    torch.cuda.synchronize()
    err_t = (out_t.float() - expected).abs().max().item()
    t = {name: graph_us(fn) for name, fn in (("full", triton(full)), ("wide", triton(wide_only, merge=False)),
                                             ("narrow", triton(narrow_only, wide=False, merge=False)),
                                             ("empty", triton(empty, merge=False)))}
    print(f"  triton ({len(plan.wide_items)}+{len(plan.narrow_items)} items, {lanes} lanes): full {t['full']:5.1f} | "
          f"wide alone {t['wide']:5.1f} | narrow alone {t['narrow']:5.1f} | empty launch {t['empty']:4.1f} us; "
          f"err {err_t:.2e}")

    sums = torch.empty(1 << 14, DIM, device="cuda")
    line = []
    for chunk in (256, 512):
        once = fca_ranges(groups, per_group, 8192, 256, chunk, "cuda")
        prefix_rows = once[: groups * 8192 // chunk]
        for name, ranges in (("all once", once), ("prefix once", prefix_rows)):
            def run(layer, ranges=ranges):
                k, v = caches[layer]
                _read_ranges[(len(ranges) * KV_HEADS,)](k, v, tables, ranges, sums, *k.stride()[:3], tables.stride(0),
                                                       NUM_KV_HEADS=KV_HEADS, HEAD_DIM=DIM, BLOCK_SIZE=BLOCK,
                                                       BLOCK_N=128, num_warps=4)
            line.append(f"{name} c{chunk} {graph_us(run):5.1f}")
    print("  read floors (us): " + " | ".join(line))
    for rows, stages, factor, per_row in VARIANTS:
        warps = rows // 16
        options = dict(NUM_HEADS=HEADS, NUM_KV_HEADS=KV_HEADS, GROUP=GROUP, HEAD_DIM=DIM, BLOCK_SIZE=BLOCK,
                       BLOCK_M=rows, BLOCK_N=64, WARPS=warps, STAGES=stages, num_warps=warps)
        if rows == 128:
            options["maxnreg"] = 128
        gtiles = TileShape(GROUP, wide_rows=rows, chunk_per_row=per_row)
        k0, v0 = caches[0]
        probe = attend_wide_decode[(1,)](
            q, k0, v0, out_t, ws.partial_out, ws.partial_lse, tables, full.wide_items, 0, full.query_index,
            SCALE * kernel.LOG2E, q.stride(0), q.stride(1), *k0.stride()[:3], out_t.stride(0), out_t.stride(1),
            tables.stride(0), **options)
        probe._init_handles()
        programs = kernel.programs_per_sm(probe.n_regs, warps, probe.metadata.shared) * SMS
        plan, full, wide_only, narrow_only, empty = plans(batch, gtiles, factor * target, programs // KV_HEADS)
        ws_g = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
        out_g = torch.empty_like(q)

        def gluon(layer, dp=full, n=len(plan.wide_items)):
            k_cache, v_cache = caches[layer]
            return attend_wide_decode[(programs,)](
                q, k_cache, v_cache, out_g, ws_g.partial_out, ws_g.partial_lse, tables, dp.wide_items, n,
                dp.query_index, SCALE * kernel.LOG2E, q.stride(0), q.stride(1), *k_cache.stride()[:3],
                out_g.stride(0), out_g.stride(1), tables.stride(0), **options)

        def combined(layer):
            gluon(layer)
            kernel.paged_attention(q, *caches[layer], tables, positions, narrow_only, ws_g, SCALE, tiles, wide=False,
                                   out=out_g, decode=True)

        compiled = gluon(0)
        compiled._init_handles()
        fit = kernel.programs_per_sm(compiled.n_regs, warps, compiled.metadata.shared)
        combined(0)
        torch.cuda.synchronize()
        err = (out_g.float() - expected).abs().max().item()
        g_wide = graph_us(gluon)
        g_empty = graph_us(lambda layer: gluon(layer, n=0))
        g_comb = graph_us(combined)
        print(f"  gluon {rows} rows st{stages} x{factor} c{per_row} ({compiled.n_regs} regs, {compiled.n_spills} spills, "
              f"{compiled.metadata.shared} B, {fit}/SM, {programs} programs; {len(plan.wide_items)}+"
              f"{len(plan.narrow_items)} items): wide alone {g_wide:5.1f} | + triton narrow + merge {g_comb:5.1f} | "
              f"empty launch {g_empty:4.1f} us; err {err:.2e}")


def main():
    print(torch.cuda.get_device_name())
    for label, groups, per_group in (("4x16", 4, 16), ("1x16", 1, 16)):
        print(f"[{label}]")
        for rep in range(1):
            try:
                case(groups, per_group)
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    main()
