"""PROTOTYPE driver: the Gluon 128-row wide tiles launched eagerly, for ncu.  python3 ab/gluon/ncu_wide.py [ROWS STAGES]"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).parent)]

from fca import BLOCK, DIM, HEADS, KV_HEADS, SCALE, paged_batch  # noqa: E402
from wide_decode import attend_wide_decode  # noqa: E402

from arctic_rl_core.zorro.attention import triton_attention as kernel  # noqa: E402
from arctic_rl_core.zorro.attention.forest import build_forest  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape, plan_decode  # noqa: E402

GROUP = HEADS // KV_HEADS
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 128
stages = int(sys.argv[2]) if len(sys.argv) > 2 else 3
warps = rows // 16
SMS = torch.cuda.get_device_properties(0).multi_processor_count
batch = paged_batch(4, 16, 8192, 256)
caches, q, tables = batch["caches"], batch["q"], batch["block_tables"]
options = dict(NUM_HEADS=HEADS, NUM_KV_HEADS=KV_HEADS, GROUP=GROUP, HEAD_DIM=DIM, BLOCK_SIZE=BLOCK, BLOCK_M=rows,
               BLOCK_N=64, WARPS=warps, STAGES=stages, num_warps=warps)
if rows == 128:
    options["maxnreg"] = 128
tiles = TileShape(GROUP, wide_rows=rows, chunk_per_row=2 if rows == 128 else 4)
programs = 2 * SMS if rows == 128 else 4 * SMS
plan = plan_decode(build_forest(batch["tables"], batch["lengths"], BLOCK), batch["lengths"], tiles,
                   2 * 4 * SMS // KV_HEADS, lanes=programs // KV_HEADS)
dp = kernel.DevicePlan.from_plan(plan, "cuda")
ws = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
out = torch.empty_like(q)
for i in range(6):
    k_cache, v_cache = caches[i % len(caches)]
    c = attend_wide_decode[(programs,)](
        q, k_cache, v_cache, out, ws.partial_out, ws.partial_lse, tables, dp.wide_items, len(plan.wide_items),
        dp.query_index, SCALE * kernel.LOG2E, q.stride(0), q.stride(1), *k_cache.stride()[:3], out.stride(0),
        out.stride(1), tables.stride(0), **options)
torch.cuda.synchronize()
print(f"gluon {rows} rows st{stages}: {c.n_regs} regs {c.n_spills} spills {c.metadata.shared} B shared, {programs} "
      f"programs, {len(plan.wide_items)} wide items")
