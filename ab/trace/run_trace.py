"""PROTOTYPE driver: where the attention launch's time goes, per program, from in-kernel timestamps.

    (device, repo root) source .whl/setup.sh && python3 ab/trace/run_trace.py
"""
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).parent)]

import traced  # noqa: E402
from fca import BLOCK, DIM, HEADS, KV_HEADS, LAYERS, SCALE, graph_us, paged_batch  # noqa: E402

from arctic_rl_core.zorro.attention import triton_attention as prod  # noqa: E402
from arctic_rl_core.zorro.attention.forest import build_forest  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape, plan_decode  # noqa: E402

kernel = traced.load()
MAXU = kernel.MAXU_
SLOTS = 2 * MAXU + 6
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def case(groups, per_group):
    batch = paged_batch(groups, per_group, 8192, 256)
    caches, q, tables, positions = batch["caches"], batch["q"], batch["block_tables"], batch["positions"]
    import os
    tiles = TileShape(HEADS // KV_HEADS, **({'narrow_block_n': int(os.environ['NBN'])} if 'NBN' in os.environ else {}))
    target = 4 * SMS // KV_HEADS
    forest = build_forest(batch["tables"], batch["lengths"], BLOCK)
    traces = torch.zeros(LAYERS, 4096, SLOTS, dtype=torch.int64, device="cuda")
    kernel.TRACE_BUF[0] = traces[0]
    # Build once (the lanes come from the compiled kernel), then plan as the engine does.
    plan0 = plan_decode(forest, batch["lengths"], tiles, target)
    dp0 = kernel.DevicePlan.from_plan(plan0, "cuda")
    ws0 = kernel.Workspace.allocate(plan0.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
    kernel.paged_attention(q, *caches[0], tables, positions, dp0, ws0, SCALE, tiles, decode=True)
    lanes = kernel.plan_lanes(HEADS, *caches[0], tiles, torch.bfloat16)
    plan = plan_decode(forest, batch["lengths"], tiles, target, lanes=lanes)
    dp = kernel.DevicePlan.from_plan(plan, "cuda")
    ws = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
    out = torch.empty_like(q)
    build = next(iter(kernel.BUILDS.values()))
    programs = build.programs

    def run(layer, merge=True):
        kernel.TRACE_BUF[0] = traces[layer]
        kernel.paged_attention(q, *caches[layer], tables, positions, dp, ws, SCALE, tiles, out=out, decode=True,
                               merge=merge)

    # Same launches through the production module, for the instrumentation's cost.
    pdp = prod.DevicePlan.from_plan(plan, "cuda")
    pws = prod.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
    pout = torch.empty_like(q)

    def run_prod(layer, merge=True):
        prod.paged_attention(q, *caches[layer], tables, positions, pdp, pws, SCALE, tiles, out=pout, decode=True,
                             merge=merge)

    # The lane balance's fixed cost per unit (plan.ITEM_COST, in 64-key steps), timed with the production kernel.
    from arctic_rl_core.zorro.attention import plan as plan_module
    default_cost = plan_module.ITEM_COST
    line = []
    for cost in (default_cost, 2, 3, 4, 6, 8, default_cost):
        plan_module.ITEM_COST = cost
        alt = plan_decode(forest, batch["lengths"], tiles, target, lanes=lanes)
        adp = prod.DevicePlan.from_plan(alt, "cuda")
        aws = prod.Workspace.allocate(alt.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
        aout = torch.empty_like(q)
        t = graph_us(lambda layer: prod.paged_attention(q, *caches[layer], tables, positions, adp, aws, SCALE, tiles,
                                                        out=aout, decode=True))
        line.append(f"{cost}: {t:.1f} ({len(alt.wide_items)}+{len(alt.narrow_items)})")
    plan_module.ITEM_COST = default_cost
    print("  FCA us/layer by ITEM_COST: " + " | ".join(line))
    t_traced = graph_us(run)
    t_prod = graph_us(run_prod)
    t_traced_nomerge = graph_us(lambda layer: run(layer, merge=False))
    t_prod_nomerge = graph_us(lambda layer: run_prod(layer, merge=False))
    torch.cuda.synchronize()
    assert (out.float() - pout.float()).abs().max().item() == 0.0
    print(f"[{groups}x{per_group}] {programs} programs ({build.registers} regs), items {len(plan.wide_items)} wide + "
          f"{len(plan.narrow_items)} narrow, lanes {lanes}")
    print(f"  graph us/layer: traced {t_traced:.1f} (attend only {t_traced_nomerge:.1f}) | production {t_prod:.1f} "
          f"(attend only {t_prod_nomerge:.1f})")

    # Units each program ran, in order: program p runs units p, p + P, ... (wide items' units first).
    wide, narrow = plan.wide_items, plan.narrow_items
    units = [("W", it) for it in wide for _ in range(KV_HEADS)] + [("N", it) for it in narrow for _ in range(KV_HEADS)]
    for layer in (LAYERS // 2, LAYERS - 1):
        tr = traces[layer, :programs].cpu().numpy()
        g0, c0, sm = tr[:, 0], tr[:, 1], tr[:, 2]
        c_end, g_end, nunits = tr[:, 3 + 2 * MAXU], tr[:, 4 + 2 * MAXU], tr[:, 5 + 2 * MAXU]
        # Clock rate from each program's own clock and global-timer spans.
        ghz = np.median((c_end - c0) / np.maximum(g_end - g0, 1))
        t0 = g0.min()
        start_ns = g0 - t0
        end_ns = start_ns + (c_end - c0) / ghz
        print(f"  layer {layer}: clock {ghz:.2f} GHz; span {end_ns.max():.0f} ns; programs start over "
              f"{np.percentile(start_ns, [0, 50, 90, 100]).round()} ns; end at {np.percentile(end_ns, [0, 10, 50, 90, 100]).round()} ns")
        rows = []
        for p in range(programs):
            prev = c0[p]
            for j in range(min(int(nunits[p]), MAXU)):
                u0, u1 = tr[p, 3 + 2 * j], tr[p, 4 + 2 * j]
                kind, it = units[p + j * programs]
                keys = int(it[4] - it[3])
                rows.append((p, j, kind, keys, (u0 - prev) / ghz, (u1 - u0) / ghz, (u0 - c0[p]) / ghz + start_ns[p],
                             (u1 - c0[p]) / ghz + start_ns[p]))
                prev = u1
        rows = np.array([(r[0], r[1], r[2] == "W", r[3], r[4], r[5], r[6], r[7]) for r in rows])
        for kind, name in ((1, "wide"), (0, "narrow")):
            sel = rows[rows[:, 2] == kind]
            if len(sel) == 0:
                continue
            keys, dur = sel[:, 3], sel[:, 5]
            steps = np.ceil(keys / 64)
            a = np.vstack([np.ones_like(steps), steps]).T
            coef = np.linalg.lstsq(a, dur, rcond=None)[0] if len(set(steps)) > 1 else (dur.mean(), 0.0)
            print(f"    {name:6s} units {len(sel):4d}: keys {np.percentile(keys, [0, 50, 100])}; duration ns "
                  f"{np.percentile(dur, [0, 10, 50, 90, 100]).round()}; fit {coef[0]:.0f} ns + {coef[1]:.0f} ns/step; "
                  f"first unit of a program: {np.median(sel[sel[:, 1] == 0][:, 5]) if (sel[:, 1] == 0).any() else float('nan'):.0f} ns, later: "
                  f"{np.median(sel[sel[:, 1] > 0][:, 5]) if (sel[:, 1] > 0).any() else float('nan'):.0f} ns")
        first = rows[rows[:, 1] == 0]
        print(f"    from program start to first unit's start: {np.percentile(first[:, 4], [0, 50, 100]).round()} ns; "
              "")
        # The last programs to end: what they ran.
        order = np.argsort(-end_ns)[:6]
        for p in order:
            mine = rows[rows[:, 0] == p]
            desc = " ".join(f"{'W' if r[2] else 'N'}{int(r[3])}:{r[6]:.0f}-{r[7]:.0f}" for r in mine)
            print(f"    late program {p} (SM {sm[p]}): start {start_ns[p]:.0f}, end {end_ns[p]:.0f} ns: {desc}")
        busy = rows[:, 5].sum() / programs
        print(f"    mean busy per program {busy:.0f} ns of the {end_ns.max():.0f} ns span")


def main():
    print(torch.cuda.get_device_name())
    for groups, per_group in ((4, 16), (1, 16)):
        case(groups, per_group)


if __name__ == "__main__":
    main()
