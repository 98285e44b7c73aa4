"""PROTOTYPE driver (run on the GPU from the repo root, with this folder copied to ab/gluon):

    cp -r /work/notes/gluon ab/ && (device) source .whl/setup.sh && python3 ab/gluon/bench.py

The plan's wide items through the Gluon kernel (wide_decode.py), its narrow items and the merge through our
Triton kernel (paged_attention with the wide count set to 0), against paged_attention doing all of it, on
fca.py's cases. Checks the outputs against the fp32 reference first.
"""

import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).parent)]

from fca import BLOCK, DIM, HEADS, KV_HEADS, SCALE, graph_us, paged_batch  # noqa: E402
from wide_decode import attend_wide_decode  # noqa: E402

from arctic_rl_core.zorro.attention import triton_attention as kernel  # noqa: E402
from arctic_rl_core.zorro.attention.forest import build_forest  # noqa: E402
from arctic_rl_core.zorro.attention.plan import TileShape, plan_decode  # noqa: E402
from arctic_rl_core.zorro.attention.reference import paged_decode_attention  # noqa: E402

GROUP = HEADS // KV_HEADS


def programs_for(compiled) -> int:
    compiled._init_handles()  # n_regs is read when the binary is loaded
    props = torch.cuda.get_device_properties(0)
    return props.multi_processor_count * kernel.programs_per_sm(compiled.n_regs, 4, compiled.metadata.shared)


def case(groups, per_group, tiles, target):
    batch = paged_batch(groups, per_group, 8192, 256)
    lengths, caches, q = batch["lengths"], batch["caches"], batch["q"]
    tables, positions = batch["block_tables"], batch["positions"]
    plan = plan_decode(build_forest(batch["tables"], lengths, BLOCK), lengths, tiles, target)
    device_plan = kernel.DevicePlan.from_plan(plan, "cuda")
    narrow_only = kernel.DevicePlan.from_plan(plan, "cuda")
    narrow_only.counts[0] = 0
    wide_items = device_plan.wide_items
    num_wide = len(plan.wide_items)
    workspace = kernel.Workspace.allocate(plan.num_partial_rows, HEADS, DIM, "cuda", torch.bfloat16)
    out_ref, out_new = torch.empty_like(q), torch.empty_like(q)
    grid = [4 * torch.cuda.get_device_properties(0).multi_processor_count]

    def gluon_wide(layer):
        k_cache, v_cache = caches[layer]
        return attend_wide_decode[(grid[0],)](
            q, k_cache, v_cache, out_new, workspace.partial_out, workspace.partial_lse, tables, wide_items, num_wide,
            device_plan.query_index, SCALE * kernel.LOG2E, q.stride(0), q.stride(1), *k_cache.stride()[:3],
            out_new.stride(0), out_new.stride(1), tables.stride(0),
            NUM_HEADS=HEADS, NUM_KV_HEADS=KV_HEADS, GROUP=GROUP, HEAD_DIM=DIM, BLOCK_SIZE=BLOCK, BLOCK_M=64,
            BLOCK_N=64, WARPS=4, num_warps=4,
        )

    def new(layer):
        gluon_wide(layer)
        kernel.paged_attention(q, *caches[layer], tables, positions, narrow_only, workspace, SCALE, tiles,
                               wide=False, out=out_new, decode=True)

    def old(layer):
        kernel.paged_attention(q, *caches[layer], tables, positions, device_plan, workspace, SCALE, tiles,
                               out=out_ref, decode=True)

    compiled = gluon_wide(0)
    grid[0] = programs_for(compiled)
    print(f"  gluon build: {compiled.n_regs} registers, {compiled.n_spills} spills, {compiled.metadata.shared} B "
          f"shared, {grid[0]} programs; plan {num_wide}+{len(plan.narrow_items)} items")
    expected = paged_decode_attention(q.float(), caches[0][0].float(), caches[0][1].float(), tables, lengths, SCALE)
    new(0)
    old(0)
    torch.cuda.synchronize()
    print(f"  max |new - ref| {(out_new.float() - expected).abs().max().item():.2e}, "
          f"|old - ref| {(out_ref.float() - expected).abs().max().item():.2e}")
    for rep in range(3):
        t_old, t_new = graph_us(old), graph_us(new)
        t_wide = graph_us(gluon_wide)
        print(f"  rep {rep}: triton {t_old:5.1f} us | gluon wide + triton narrow + merge {t_new:5.1f} us "
              f"(gluon wide alone {t_wide:5.1f})")


def unit_check():
    """One item over a contiguous cache, straight to the output and to partial rows, against torch."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    n, length, start = 9, 1000, 37
    blocks = -(-length // BLOCK)
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16()
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16()
    q = torch.randn(n, HEADS, DIM, generator=gen, device="cuda").bfloat16()
    tables = torch.arange(blocks, dtype=torch.int32, device="cuda")[None]
    query_index = torch.arange(n, dtype=torch.int32, device="cuda")
    keys = k_cache.reshape(-1, KV_HEADS, DIM)[start:length].float().repeat_interleave(GROUP, 1)  # [L, H, D]
    values = v_cache.reshape(-1, KV_HEADS, DIM)[start:length].float().repeat_interleave(GROUP, 1)
    scores = torch.einsum("nhd,lhd->nhl", q.float(), keys) * SCALE
    expected = torch.einsum("nhl,lhd->nhd", scores.softmax(-1), values)
    for partial_row in (-1, 3):
        items = torch.tensor([[0, n, 0, start, length, partial_row]], dtype=torch.int32, device="cuda")
        out = torch.zeros_like(q)
        part_o = torch.zeros(n + 3, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        part_lse = torch.zeros(n + 3, HEADS, dtype=torch.float32, device="cuda")
        attend_wide_decode[(2,)](
            q, k_cache, v_cache, out, part_o, part_lse, tables, items, 1, query_index, SCALE * kernel.LOG2E,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], out.stride(0), out.stride(1), tables.stride(0),
            NUM_HEADS=HEADS, NUM_KV_HEADS=KV_HEADS, GROUP=GROUP, HEAD_DIM=DIM, BLOCK_SIZE=BLOCK, BLOCK_M=64,
            BLOCK_N=64, WARPS=4, num_warps=4,
        )
        torch.cuda.synchronize()
        got = out if partial_row < 0 else part_o[3:]
        line = f"  unit (partial row {partial_row}): max |out - ref| {(got.float() - expected).abs().max().item():.2e}"
        if partial_row >= 0:
            lse = scores.logsumexp(-1)
            line += f", max |lse - ref| {(part_lse[3:] - lse).abs().max().item():.2e}"
        print(line)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = TileShape(GROUP)
    print(torch.cuda.get_device_name())
    try:
        unit_check()
    except Exception:
        traceback.print_exc()
    for label, groups, per_group in (("4x16", 4, 16), ("1x16", 1, 16)):
        for factor in (1.0, 2.0):
            target = int(factor * 4 * sms // KV_HEADS)
            print(f"[{label}, target {target} items]")
            try:
                case(groups, per_group, tiles, target)
            except Exception:  # the other cases' figures still print
                traceback.print_exc()


if __name__ == "__main__":
    main()
