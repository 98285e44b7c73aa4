"""FCA kernel variants side by side on one GPU: attend and merge times per case, and exactness against plain.

python benchmarks/fca_sweep.py [--quick | --suffixes | --plain] [--tiles name=value,... ...]
                               [--carveout none|PERCENT]

``--carveout none`` leaves the attention and merge kernels' shared-memory
carveout to Triton and the driver (``triton_attention.SHARED_CARVEOUT``);
a percentage asks for that one instead. It holds for the whole run.

``--tiles`` times the given variants of the default tile shape (each a
``name=value,...`` list, as ``fca.py --tiles`` takes) between two runs of
the default, instead of the built-in list; with ``--plain`` or
``--suffixes``, those runs use each variant in turn.

``--suffixes`` times the default alone over 8K shared prefixes with shorter
suffixes (256, 64, 1 positions): what the per-request suffix units cost.

``--plain`` times plain decode (no shared prefix: ``sampling.py``'s case) at
16 and 64 requests and several context lengths, with plans of fewer items
than the engine's target down to one per request: what splitting each
context into more units, and the merge launch that the split needs, cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from fca import BLOCK, DIM, HEADS, KV_HEADS, SCALE, graph_us, paged_batch, tile_shape

from arctic_rl_core.zorro.attention import triton_attention as kernel
from arctic_rl_core.zorro.attention.forest import PrefixForest, build_forest
from arctic_rl_core.zorro.attention.plan import ROWS_128, TileShape, plan_decode

GROUP = HEADS // KV_HEADS
CASES = (("4x16", 4, 16), ("1x16", 1, 16))


def variants(quick: bool) -> list[tuple[TileShape, float]]:
    """(tile shape, multiple of the engine's target item count)."""
    default = TileShape(GROUP)
    rows128 = dataclasses.replace(default, **ROWS_128)
    # The variants that the code last changed come first, so a call that runs out of time still has them.
    out = [
        (default, 1.0),
        # 64-bit cache offsets (the default before the 13th session): on an H100 the plain paged kernel 2-3% slower,
        # FCA the same or 0.1-0.3 us slower. (Unmasked loads ahead, 302 instead of 325 instructions per wide step,
        # were 0.6-1.1 us slower at 4x16 in every form tried, that session.)
        (dataclasses.replace(default, int32_offsets=False), 1.0),
        (default, 1.0),  # again, for the noise between two identical rows
        # Capped registers: 3 programs per SM at 168 (no spills), 4 at 128. On an H100 the cap took the attention
        # launch alone from 22.0 to 19.2 us at 4x16 (target 0.75: one wave of 3 per SM), but the merge after it
        # took longer and 1x16 lost 2.5-3 us (12th session).
        (dataclasses.replace(default, wide_maxnreg=168), 0.75),
        (default, 0.75),
        (default, 1.5),
        (dataclasses.replace(default, wide_maxnreg=168), 1.0),
        (dataclasses.replace(default, wide_maxnreg=128), 1.0),
        # Wide steps of 128 keys (255 registers, no spills) in both widths: the per-step costs are shared by
        # twice the keys (wide tiles alone: 26.6 us at 4x16, 11.4 at 1x16 on an H100, slower too).
        (dataclasses.replace(default, block_n=128), 1.0),
        (rows128, 1.0),
        # Triton's pipeline below 5 stages, where it copies a step's keys only at the end of the step before.
        (dataclasses.replace(default, wide_stages=3), 1.0),
        (dataclasses.replace(default, block_n=32), 1.0),  # 3 programs per SM
        (dataclasses.replace(default, early_loads=False), 1.0),  # every load after the wait
        (dataclasses.replace(default, stages=3), 1.0),  # deeper pipelining of the narrow (suffix) tiles
        # Fewer, longer units: at 4x16 the wide units fill about one wave of programs at 0.73 (chunks of 512)
        (default, 0.85),
        (default, 0.73),
        (default, 0.6),
        (default, 2.0),
        (default, 0.5),  # one unit per resident program: longer prefix chunks, no second round of suffix units
        (dataclasses.replace(default, chunk_per_row=2), 1.0),  # shorter prefix chunks: more, shorter units
        (dataclasses.replace(default, chunk_per_row=8), 1.0),
        # 64-row tiles over 8 warps: 178 registers, one program per SM, half the speed (12th session).
        (dataclasses.replace(default, wide_warps=8), 1.0),
        (dataclasses.replace(default, pdl=False), 1.0),
    ]
    return out[:4] if quick else out


def measure(batch: dict, tiles: TileShape, target: int) -> dict:
    n = len(batch["lengths"])
    lengths, caches, q = batch["lengths"], batch["caches"], batch["q"]
    forest = build_forest(batch["tables"], lengths, BLOCK)
    result = {}
    outs = {}
    lanes = None  # the first run builds the kernel; the others' plans are balanced over its lanes, as the engine's
    for name, f, wide, merge in (
        ("even", forest, True, True),
        ("fca", forest, True, True),
        ("attend", forest, True, False),
        ("plain", PrefixForest.unshared(n), False, True),
    ):
        plan = plan_decode(f, lengths, tiles, target, lanes=lanes)
        device_plan = kernel.DevicePlan.from_plan(plan, "cuda")
        workspace = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
        out = torch.empty_like(q)

        def run(layer, device_plan=device_plan, workspace=workspace, out=out, wide=wide, merge=merge):
            kernel.paged_attention(q, *caches[layer], batch["block_tables"], batch["positions"], device_plan,
                                   workspace, SCALE, tiles, wide=wide, merge=merge, out=out)  # fmt: skip

        result[name] = graph_us(run)
        outs[name] = out
        lanes = kernel.plan_lanes(HEADS, *caches[0], tiles, torch.bfloat16)
        if name == "fca":
            result["items"] = f"{len(plan.wide_items)}+{len(plan.narrow_items)}"
    result["diff"] = (outs["fca"].float() - outs["plain"].float()).abs().max().item()
    return result


def plain_targets(requests: int, length: int, tiles: TileShape, engine_target: int) -> None:
    """Plain decode of ``requests`` contexts of ``length``, planned for the engine's item target and fewer: one line
    per plan, microseconds per layer with its merge launch and, where it has no partials, without."""
    batch = paged_batch(requests, 1, 0, length)
    lengths, caches, q = batch["lengths"], batch["caches"], batch["q"]
    forest = PrefixForest.unshared(requests)
    cells = []
    for target in sorted({engine_target, engine_target // 2, engine_target // 4, 2 * requests, requests}, reverse=True):
        plan = plan_decode(forest, lengths, tiles, target)
        device_plan = kernel.DevicePlan.from_plan(plan, "cuda")
        workspace = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
        out = torch.empty_like(q)
        times = {}
        for merge in (True, False) if plan.num_partial_rows == 0 else (True,):

            def run(layer, device_plan=device_plan, workspace=workspace, out=out, merge=merge):
                kernel.paged_attention(q, *caches[layer], batch["block_tables"], batch["positions"], device_plan,
                                       workspace, SCALE, tiles, wide=False, merge=merge, out=out)  # fmt: skip

            times[merge] = graph_us(run)
        no_merge = f" (no merge launch {times[False]:5.1f})" if False in times else ""
        cells.append(f"target {target:3d}: {plan.num_items:3d} items, {plan.num_partial_rows:4d} partial rows, "
                     f"{times[True]:5.1f} us{no_merge}")  # fmt: skip
    print(f"plain {requests:2d} x {length:5d}: " + " | ".join(cells), flush=True)


def describe(r: dict) -> str:
    """One ``measure`` result on a line: microseconds per layer, the plan's items, FCA's difference from plain."""
    return (f"fca {r['fca']:5.1f} (even {r['even']:5.1f}) attend {r['attend']:5.1f} plain {r['plain']:5.1f} "
            f"items {r['items']:>7s} diff {r['diff']:.1e}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--suffixes", action="store_true", help="the default with suffixes of 256, 64 and 1")
    parser.add_argument("--plain", action="store_true", help="plain decode, planned for fewer items than the engine")
    parser.add_argument("--tiles", nargs="+", default=[], metavar="CHANGES",
                        help="variants (name=value,...) to time between two runs of the default")  # fmt: skip
    parser.add_argument("--carveout", type=lambda v: None if v == "none" else int(v), default=kernel.SHARED_CARVEOUT,
                        help="the attention and merge kernels' shared-memory carveout, percent, or none")  # fmt: skip
    args = parser.parse_args()
    kernel.SHARED_CARVEOUT = args.carveout  # before the first kernel is loaded, which is when it is asked for
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs; shared-memory carveout {args.carveout}")
    default = TileShape(GROUP)
    given = [default, *(tile_shape(changes) for changes in args.tiles), default] if args.tiles else None
    if args.plain:
        for tiles in given or [default]:
            if given:
                print(f"tiles: {tiles}", flush=True)
            for requests in (64, 16):
                for length in (128, 256, 384, 1024, 4096):
                    plain_targets(requests, length, tiles, 4 * sms // KV_HEADS)
        return
    if args.suffixes:
        target = 4 * sms // KV_HEADS
        for tiles in given or [default]:
            if given:
                print(f"tiles: {tiles}", flush=True)
            for label, groups, per_group in CASES:
                for suffix in (256, 64, 1, 256):
                    r = measure(paged_batch(groups, per_group, 8192, suffix), tiles, target)
                    print(f"{label} prefix 8192 suffix {suffix:3d}: {describe(r)}", flush=True)
        return
    batches = {label: paged_batch(g, per, 8192, 256) for label, g, per in CASES}
    for tiles, factor in [(tiles, 1.0) for tiles in given] if given else variants(args.quick):
        target = int(factor * 4 * sms // KV_HEADS)
        start = time.perf_counter()
        kernel.BUILDS.clear()
        cells = []
        for label, batch in batches.items():
            try:
                cells.append(f"{label}: {describe(measure(batch, tiles, target))}")
            except Exception as e:  # a variant that fails to compile or run is reported, not fatal
                cells.append(f"{label}: {type(e).__name__}: {str(e)[:120]}")
        print(f"rows {tiles.wide_rows:3d} w{tiles.wide_warps} bn {tiles.block_n:3d} st {tiles.stages} "
              f"cpr {tiles.chunk_per_row} reg {tiles.wide_maxnreg or 0:3d} pdl {tiles.pdl:d} "
              f"early {tiles.early_loads:d} wst {tiles.wide_stages} "
              f"i32 {tiles.int32_offsets:d} tgt {target:3d} "
              f"programs {sorted({b.programs for b in kernel.BUILDS.values()})} "
              f"regs/spills {sorted({(b.registers, b.spills) for b in kernel.BUILDS.values()})} "
              f"({time.perf_counter() - start:4.1f}s) | " + " | ".join(cells), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
