"""How fast can any kernel read FCA's 4x16 bytes (each group's 8K prefix once + 64 suffixes of 256) from the paged
cache at this size? A read-only Triton kernel (no attention math), timed like fca.py (a graph of 16 layers)."""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from fca import BLOCK, graph_us, paged_batch  # noqa: E402


@triton.jit
def read_paged(K, V, TABLES, OUT, prefix_programs, prefix_chunks, suffix_chunks, stride_kb, stride_ks, stride_kh,
               stride_bt, PER_GROUP: tl.constexpr, PREFIX: tl.constexpr, SUFFIX: tl.constexpr, CHUNK: tl.constexpr,
               HEADS_PER_PROGRAM: tl.constexpr, NUM_KV_HEADS: tl.constexpr, DIM: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    head_sets: tl.constexpr = NUM_KV_HEADS // HEADS_PER_PROGRAM
    head0 = (pid % head_sets) * HEADS_PER_PROGRAM
    unit = pid // head_sets
    if unit < prefix_programs:
        row = (unit // prefix_chunks) * PER_GROUP
        start = (unit % prefix_chunks) * CHUNK
        length = CHUNK
    else:
        u = unit - prefix_programs
        row = u // suffix_chunks
        start = PREFIX + (u % suffix_chunks) * CHUNK
        length = tl.minimum(CHUNK, PREFIX + SUFFIX - start)
    W: tl.constexpr = HEADS_PER_PROGRAM * DIM
    cols = tl.arange(0, W)
    acc = tl.zeros([W], dtype=tl.float32)
    for off in tl.range(0, length, BLOCK_N, num_stages=STAGES):
        pos = start + off + tl.arange(0, BLOCK_N)
        block = tl.load(TABLES + row * stride_bt + pos // BLOCK_SIZE)
        ptr = (block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + head0 * stride_kh)[:, None] + cols[None, :]
        acc += tl.sum(tl.load(K + ptr).to(tl.float32) + tl.load(V + ptr).to(tl.float32), axis=0)
    tl.store(OUT + pid * W + cols, acc)


def main():
    print(torch.cuda.get_device_name())
    groups, per_group, prefix, suffix = 4, 16, 8192, 256
    batch = paged_batch(groups, per_group, prefix, suffix)
    caches, tables = batch["caches"], batch["block_tables"]
    kv_heads, dim = caches[0][0].shape[2], caches[0][0].shape[3]
    nbytes = (groups * prefix + groups * per_group * suffix) * kv_heads * dim * 2 * 2
    out = torch.empty(1 << 20, device="cuda")
    print(f"bytes {nbytes / 1e6:.1f} MB; at 3.35 TB/s {nbytes / 3.35e6:.1f} us")
    flat = [torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda") for _ in range(16)]
    print(f"  torch sum over a contiguous tensor of those bytes: {graph_us(lambda l: flat[l].sum()):.1f} us")
    dst = [torch.empty_like(f) for f in flat]
    print(f"  torch copy_ of them (read + write): {graph_us(lambda l: dst[l].copy_(flat[l])):.1f} us")
    for heads_pp in (1, 2):
        for chunk in (256, 512, 1024):
            for block_n, warps, stages in ((64, 4, 3), (128, 4, 3), (64, 4, 4), (128, 8, 3)):
                prefix_chunks, suffix_chunks = prefix // chunk, -(-suffix // chunk)
                prefix_programs = groups * prefix_chunks
                grid = ((prefix_programs + groups * per_group * suffix_chunks) * (kv_heads // heads_pp),)

                def run(layer):
                    k, v = caches[layer]
                    read_paged[grid](k, v, tables, out, prefix_programs, prefix_chunks, suffix_chunks,
                                     *k.stride()[:3], tables.stride(0), PER_GROUP=per_group, PREFIX=prefix,
                                     SUFFIX=suffix, CHUNK=chunk, HEADS_PER_PROGRAM=heads_pp,
                                     NUM_KV_HEADS=kv_heads, DIM=dim, BLOCK_SIZE=BLOCK, BLOCK_N=block_n,
                                     STAGES=stages, num_warps=warps)

                us = graph_us(run)
                print(f"  read_paged heads/program {heads_pp} chunk {chunk:4d} block_n {block_n:3d} warps {warps} "
                      f"stages {stages}: {grid[0]:4d} programs {us:5.1f} us = {nbytes / us / 1e6:4.2f} TB/s")


if __name__ == "__main__":
    main()
