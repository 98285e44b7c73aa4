"""PROTOTYPE: kernel variants x the lane balance's narrow step cost, alternating, over several forests.

    (device, repo root) source .whl/setup.sh && python3 ab/nar/ab.py
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).parent)]

import dataclasses  # noqa: E402

import fca_sweep  # noqa: E402
import variants  # noqa: E402
from fca import HEADS, KV_HEADS, paged_batch  # noqa: E402

from arctic_rl_core.zorro.attention import plan as plan_module  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape  # noqa: E402

SMS = torch.cuda.get_device_properties(0).multi_processor_count
CASES = ((4, 16, 8192, 256), (1, 16, 8192, 256), (8, 8, 4096, 256), (1, 64, 8192, 256))
BASE = TileShape(HEADS // KV_HEADS)
# (label, kernel variant, tile changes, narrow step cost, narrow step keys with wide tiles)
ROWS = [
    ("base", "base", {}, 1.0, 64),
    ("cpr3", "base", dict(chunk_per_row=3), 1.0, 64),
    ("l2o", "l2o", {}, 1.0, 64),
    ("l2o cpr3", "l2o", dict(chunk_per_row=3), 1.0, 64),
    ("base", "base", {}, 1.0, 64),
    ("cpr3", "base", dict(chunk_per_row=3), 1.0, 64),
]


def main():
    print(torch.cuda.get_device_name(), flush=True)
    modules = {name: variants.load(name) for name in {row[1] for row in ROWS}}
    target = 4 * SMS // KV_HEADS
    for groups, per, prefix, suffix in CASES:
        batch = paged_batch(groups, per, prefix, suffix)
        for rnd in range(2):
            cells = []
            for label, variant, changes, narrow, keys in ROWS:
                fca_sweep.kernel = modules[variant]
                modules[variant].NARROW_N_WITH_WIDE = keys
                r = fca_sweep.measure(batch, dataclasses.replace(BASE, **changes), target)
                cells.append(f"{label}: {r['fca']:5.1f}/{r['attend']:5.1f} ({r['items']}) {r['diff']:.0e}")
            print(f"{groups}x{per} p{prefix} s{suffix} r{rnd} plain {r['plain']:5.1f} | " + " | ".join(cells), flush=True)
        del batch
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
