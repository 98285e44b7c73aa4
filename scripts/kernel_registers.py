"""Registers, spills and programs per SM of the FCA kernel's variants, built for Hopper here (no GPU needed).

    python scripts/kernel_registers.py                    # every variant's registers
    python scripts/kernel_registers.py --loop             # the default wide decode tile's step loop, by opcode
    python scripts/kernel_registers.py --loop --variant int64_offsets   # a variant's
    TRITON_DISABLE_LINE_INFO=1 python scripts/kernel_registers.py --digest   # each build's PTX and cubin digests

Each row is what ``paged_attention`` would launch for a bf16 Qwen2-0.5B layer
(14 query heads, 2 KV heads, 64 dims, 16 positions per block), per thread as
``ptxas -v`` reports it. Spills are local-memory traffic in the inner loop;
programs per SM is what the persistent grid is sized from. Timings still need
the GPU (``benchmarks/fca_sweep.py``): this says why a variant may be faster.

``--digest`` says whether a change to the kernel's source changes what the
device runs: equal digests before and after (line info off, so moved lines
do not count) mean the same machine code for every variant listed here.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib

import torch

from arctic_rl_core.triton_aot import loop_opcodes, register_use
from arctic_rl_core.zorro.attention.plan import ROWS_128, TileShape
from arctic_rl_core.zorro.attention.triton_attention import compile_attention, programs_per_sm

DEFAULT = TileShape(7)
VARIANTS = {
    "default": {},
    "int64_offsets": dict(int32_offsets=False),
    "maxnreg=168": dict(wide_maxnreg=168),
    "maxnreg=128": dict(wide_maxnreg=128),
    "late_loads": dict(early_loads=False),
    "wide_stages=3": dict(wide_stages=3),
    "wide_stages=4": dict(wide_stages=4),
    "block_n=32": dict(block_n=32),
    "block_n=128": dict(block_n=128),
    "rows128": ROWS_128,
    "rows128 late_loads": {**ROWS_128, "early_loads": False},
    "rows128 block_n=32": {**ROWS_128, "block_n": 32},
    "rows128 maxnreg=None": {**ROWS_128, "wide_maxnreg": None},
}


def build(tiles: TileShape, wide: bool):
    return compile_attention(tiles, 14, 2, 64, 16, torch.bfloat16, wide)


def every_build():
    """``(variant, tiles, wide, compiled)`` for each variant's wide and narrow build, in ``VARIANTS``' order."""
    for name, change in VARIANTS.items():
        tiles = dataclasses.replace(DEFAULT, **change)
        for wide in (True, False):
            yield name, tiles, wide, build(tiles, wide)


def print_step_loop(variant: str) -> None:
    """One iteration of the wide decode tile's step loop (the loop of the PV product's HGMMA), by opcode."""
    compiled = build(dataclasses.replace(DEFAULT, **VARIANTS[variant]), wide=True)
    for branches_taken, what in ((False, "the masked step's branches included"), (True, "a whole step")):
        opcodes = collections.Counter(loop_opcodes(compiled, "tnspB", branches_taken=branches_taken))
        print(f"step loop ({variant}): {sum(opcodes.values())} instructions, {what}")
        print("  " + " ".join(f"{name} {count}" for name, count in opcodes.most_common()))


def print_digests() -> None:
    """Every variant's wide and narrow build, by the first 12 hex digits of its PTX's and its cubin's SHA-256."""
    for name, _, wide, compiled in every_build():
        ptx = hashlib.sha256(compiled.asm["ptx"].encode()).hexdigest()[:12]
        cubin = hashlib.sha256(compiled.asm["cubin"]).hexdigest()[:12]
        print(f"{name:<20} {'wide' if wide else 'narrow':<7} ptx {ptx} cubin {cubin}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", action="store_true", help="the wide tile's step loop, by opcode")
    parser.add_argument("--variant", choices=VARIANTS, default="default", help="whose step loop (with --loop)")
    parser.add_argument("--digest", action="store_true", help="each build's PTX and cubin digests")
    args = parser.parse_args()
    if args.loop:
        print_step_loop(args.variant)
        return
    if args.digest:
        print_digests()
        return
    print(f"{'variant':<20} {'tile':<7} {'warps':>5} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'smem':>7} "
          f"{'per SM':>6}")  # fmt: skip
    for name, tiles, wide, compiled in every_build():
        use = register_use(compiled)
        warps = tiles.wide_warps if wide else 4
        shared = compiled.metadata.shared
        print(f"{name:<20} {'wide' if wide else 'narrow':<7} {warps:>5} {use.registers:>5} {use.spill_stores:>9} "
              f"{use.spill_loads:>9} {shared:>7} {programs_per_sm(use.registers, warps, shared):>6}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
