"""PROTOTYPE: the lane balance's unit cost (plan.ITEM_COST) 1 / 4 / 6, alternating, over several forests."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from fca import HEADS, KV_HEADS, paged_batch  # noqa: E402
from fca_sweep import measure  # noqa: E402

from arctic_rl_core.zorro.attention import plan as plan_module  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape  # noqa: E402

SMS = torch.cuda.get_device_properties(0).multi_processor_count
CASES = ((4, 16, 8192, 256), (1, 16, 8192, 256), (8, 8, 4096, 256), (2, 32, 8192, 512), (16, 4, 2048, 128),
         (1, 64, 8192, 256))


def main():
    print(torch.cuda.get_device_name())
    tiles = TileShape(HEADS // KV_HEADS)
    target = 4 * SMS // KV_HEADS
    for groups, per, prefix, suffix in CASES:
        batch = paged_batch(groups, per, prefix, suffix)
        line = []
        for cost in (1, 4, 6, 1, 4, 6):
            plan_module.ITEM_COST = cost
            r = measure(batch, tiles, target)
            line.append(f"{cost}: {r['fca']:5.1f} ({r['items']})")
        print(f"{groups}x{per} prefix {prefix} suffix {suffix} (even {r['even']:5.1f}, plain {r['plain']:5.1f}): "
              + " | ".join(line), flush=True)
        del batch
        torch.cuda.empty_cache()
    plan_module.ITEM_COST = 1


if __name__ == "__main__":
    main()
