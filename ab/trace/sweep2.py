"""PROTOTYPE: narrow tiles' step (narrow_block_n) x the lane balance's unit cost (plan.ITEM_COST), one call."""
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from fca import DIM, HEADS, KV_HEADS, SCALE, paged_batch  # noqa: E402
from fca_sweep import measure  # noqa: E402

from arctic_rl_core.zorro.attention import plan as plan_module  # noqa: E402
from arctic_rl_core.zorro.attention import triton_attention as kernel  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape  # noqa: E402
from arctic_rl_core.zorro.attention.reference import paged_decode_attention  # noqa: E402

SMS = torch.cuda.get_device_properties(0).multi_processor_count
default = TileShape(HEADS // KV_HEADS)
VARIANTS = [
    (default, 1), (dataclasses.replace(default, narrow_block_n=128), 1),
    (dataclasses.replace(default, narrow_block_n=128, stages=3), 1),
    (default, 6), (dataclasses.replace(default, narrow_block_n=128), 4),
    (dataclasses.replace(default, narrow_block_n=128), 6), (dataclasses.replace(default, narrow_block_n=128), 3),
    (dataclasses.replace(default, narrow_block_n=32), 1), (default, 4), (default, 1),
]


def main():
    print(torch.cuda.get_device_name())
    batches = {label: paged_batch(g, per, 8192, 256) for label, g, per in (("4x16", 4, 16), ("1x16", 1, 16))}
    refs = {label: paged_decode_attention(b["q"].float(), b["caches"][-1][0].float(), b["caches"][-1][1].float(),
                                          b["block_tables"], b["lengths"], SCALE) for label, b in batches.items()}
    target = 4 * SMS // KV_HEADS
    for tiles, cost in VARIANTS:
        plan_module.ITEM_COST = cost
        kernel.BUILDS.clear()
        cells = []
        for label, batch in batches.items():
            r = measure(batch, tiles, target)
            # measure's last output is the plain run's, on the last layer: its error vs the fp32 reference.
            cells.append(f"{label}: fca {r['fca']:5.1f} (even {r['even']:5.1f}) attend {r['attend']:5.1f} plain "
                         f"{r['plain']:5.1f} items {r['items']:>7s} diff {r['diff']:.1e}")
        builds = sorted({(b.programs, b.registers, b.spills) for b in kernel.BUILDS.values()})
        print(f"nbn {tiles.narrow_block_n or tiles.block_n:3d} st {tiles.stages} cost {cost} {builds} | "
              + " | ".join(cells), flush=True)
    plan_module.ITEM_COST = 1
    # Exactness of the 128-key narrow steps against the fp32 reference (FCA and plain), last layer.
    from arctic_rl_core.zorro.attention.forest import PrefixForest, build_forest
    from arctic_rl_core.zorro.attention.plan import plan_decode
    for tiles in (default, dataclasses.replace(default, narrow_block_n=128)):
        for label, b in batches.items():
            for name, forest in (("fca", build_forest(b["tables"], b["lengths"], 16)),
                                 ("plain", PrefixForest.unshared(len(b["lengths"])))):
                plan = plan_decode(forest, b["lengths"], tiles, target)
                dp = kernel.DevicePlan.from_plan(plan, "cuda")
                ws = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
                out = kernel.paged_attention(b["q"], *b["caches"][-1], b["block_tables"], b["positions"], dp, ws,
                                             SCALE, tiles, wide=name == "fca", decode=True)
                err = (out.float() - refs[label]).abs().max().item()
                print(f"  nbn {tiles.narrow_block_n or 64} {label} {name}: max |out - fp32 ref| {err:.2e}")


if __name__ == "__main__":
    main()
