"""PROTOTYPE driver: where the attention launch's time goes, per program and within each work unit.

    (device, repo root) source .whl/setup.sh && python3 ab/trace/run_trace.py

Replays 16 layers of attention + merge as ``benchmarks/fca.py`` does, with the traced kernel (``traced.py``), and
prints per case: the launch's span, when programs start and end, each kind of unit's segments (median ns from the
unit's start: item fields, query tokens, positions, queries, first keys (wide), step loop end, unit end), a fit of
unit duration to fixed + per-step parts, and the programs that end last.
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

import os  # noqa: E402

sys.path.insert(0, str(ROOT / "ab/nar"))
import variants  # noqa: E402
from arctic_rl_core.zorro.attention import plan as plan_module  # noqa: E402

VARIANT = os.environ.get("VARIANT", "base")
TILE_CHANGES = eval(f"dict({os.environ.get('TILES', '')})")
plan_module.NARROW_STEP = float(os.environ.get("NARROW_STEP", "1"))
kernel = traced.load(variants.source(VARIANT))
kernel.NARROW_N_WITH_WIDE = int(os.environ.get("NARROW_N", "64"))
if VARIANT != "base":
    prod = variants.load(VARIANT)
    prod.NARROW_N_WITH_WIDE = kernel.NARROW_N_WITH_WIDE
MAXU, US, SLOTS = traced.MAXU, traced.UNIT_SLOTS, traced.SLOTS
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def case(groups, per_group):
    batch = paged_batch(groups, per_group, 8192, 256)
    caches, q, tables, positions = batch["caches"], batch["q"], batch["block_tables"], batch["positions"]
    import dataclasses
    tiles = dataclasses.replace(TileShape(HEADS // KV_HEADS), **TILE_CHANGES)
    target = 4 * SMS // KV_HEADS
    forest = build_forest(batch["tables"], batch["lengths"], BLOCK)
    traces = torch.zeros(LAYERS, 4096, SLOTS, dtype=torch.int64, device="cuda")
    kernel.TRACE_BUF[0] = traces[0]
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

    pdp = prod.DevicePlan.from_plan(plan, "cuda")
    pws = prod.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
    pout = torch.empty_like(q)

    def run_prod(layer, merge=True):
        prod.paged_attention(q, *caches[layer], tables, positions, pdp, pws, SCALE, tiles, out=pout, decode=True,
                             merge=merge)

    t = {name: graph_us(fn) for name, fn in (("traced", run), ("production", run_prod),
                                             ("traced attend", lambda layer: run(layer, False)),
                                             ("production attend", lambda layer: run_prod(layer, False)))}
    torch.cuda.synchronize()
    assert (out.float() - pout.float()).abs().max().item() == 0.0, "the traced kernel's output differs"
    print(f"[{groups}x{per_group}] {programs} programs ({build.registers} regs), items {len(plan.wide_items)} wide + "
          f"{len(plan.narrow_items)} narrow over {lanes} lanes; us/layer: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))

    units = [("W", it) for it in plan.wide_items for _ in range(KV_HEADS)]
    units += [("N", it) for it in plan.narrow_items for _ in range(KV_HEADS)]
    for layer in (LAYERS // 2, LAYERS - 1):
        tr = traces[layer, :programs].cpu().numpy()
        g0, c0, sm = tr[:, 0], tr[:, 1], tr[:, 2]
        end = 3 + US * MAXU
        c_end, g_end, nunits = tr[:, end], tr[:, end + 1], tr[:, end + 2]
        ghz = np.median((c_end - c0) / np.maximum(g_end - g0, 1))
        start_ns = g0 - g0.min()
        end_ns = start_ns + (c_end - c0) / ghz
        print(f"  layer {layer}: clock {ghz:.2f} GHz; span {end_ns.max():.0f} ns; programs start over "
              f"{np.percentile(start_ns, [0, 50, 100]).round()} ns, end at {np.percentile(end_ns, [0, 10, 50, 90, 100]).round()} ns")
        rows = []  # program, unit index, wide, keys, start ns, segment ends (ns from the unit's start) ..., end ns
        for p in range(programs):
            for j in range(min(int(nunits[p]), MAXU)):
                s = tr[p, 3 + US * j: 3 + US * (j + 1)]
                kind, it = units[p + j * programs]
                rel = (s - s[0]) / ghz
                rows.append([p, j, kind == "W", int(it[4] - it[3]), start_ns[p] + (s[0] - c0[p]) / ghz, *rel[1:]])
        rows = np.array(rows, dtype=float)
        for kind, name in ((1, "wide"), (0, "narrow")):
            sel = rows[rows[:, 2] == kind]
            for label, part in (("first unit", sel[sel[:, 1] == 0]), ("later units", sel[sel[:, 1] > 0])):
                if len(part) == 0:
                    continue
                med = np.median(part[:, 5:], axis=0).round()
                segs = " ".join(f"{n} {v:.0f}" for n, v in zip((*traced.STAMPS, "end"), med))
                print(f"    {name:6s} {label:11s} x{len(part):3d}, keys {np.median(part[:, 3]):.0f}: ns from its start: {segs}")
            if len(sel) > 1 and len(set(sel[:, 3])) > 1:
                steps = np.ceil(sel[:, 3] / 64)
                coef = np.linalg.lstsq(np.vstack([np.ones_like(steps), steps]).T, sel[:, -1], rcond=None)[0]
                print(f"    {name:6s} duration fit: {coef[0]:.0f} ns + {coef[1]:.0f} ns per 64-key step")
        for p in np.argsort(-end_ns)[:4]:
            mine = rows[rows[:, 0] == p]
            desc = " ".join(f"{'W' if r[2] else 'N'}{int(r[3])}:{r[4]:.0f}+{r[-1]:.0f}" for r in mine)
            print(f"    late program {p} (SM {sm[p]}): start {start_ns[p]:.0f}, end {end_ns[p]:.0f} ns: {desc}")


def main():
    print(torch.cuda.get_device_name(), VARIANT, TILE_CHANGES, plan_module.NARROW_STEP)
    for groups, per_group in ((4, 16), (1, 16)):
        case(groups, per_group)


if __name__ == "__main__":
    main()
