"""The read floor of an FCA case: how long a kernel takes that only reads the bytes FCA must read, with no math.

    python benchmarks/fca_floor.py [--shape qwen2.5-7b|llama-3-8b]   # every tiling, both of fca.py's cases

At ``fca.py``'s sizes (25 MB of KV at 4 groups x 16) a GPU does not reach its
peak bandwidth: the launch, the first loads' latency and the last programs'
tail are a large part of the time. This kernel reads each group's shared
prefix once and every request's suffix once, from the same paged cache and
block tables as the FCA kernel, and sums them so nothing is optimised away.
Its best time over a few tilings is the floor that FCA's time is compared
with, measured in the same run.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from arctic_rl_core.zorro.attention.reference import gather_kv

# (chunk, BLOCK_N, warps): the best three of the tilings timed on an H100 at 4x16 (2.0-2.2 TB/s there; ``main`` times
# them all, docs/benchmarks.md has its output).
TILINGS = ((512, 128, 4), (256, 128, 4), (512, 64, 4))
ALL_TILINGS = tuple((c, n, w) for c in (128, 256, 512, 1024) for n, w in ((64, 4), (128, 4), (128, 8)))


@triton.jit
def _read_ranges(
    K_CACHE, V_CACHE, BLOCK_TABLES, RANGES, SUMS, stride_kb, stride_ks, stride_kh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (range, KV head): the keys and values of block-table row ``RANGES[r, 0]`` at ``[start, end)``."""
    pid = tl.program_id(0)
    r = RANGES + (pid // NUM_KV_HEADS) * 3
    kv_head = pid % NUM_KV_HEADS
    table = BLOCK_TABLES + tl.load(r).to(tl.int64) * stride_bt
    start, end = tl.load(r + 1), tl.load(r + 2)
    dims = tl.arange(0, HEAD_DIM)
    total = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for offset in tl.range(start, end, BLOCK_N, num_stages=3):
        pos = offset + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        at = (block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh)[:, None] + dims[None, :]
        k = tl.load(K_CACHE + at, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(V_CACHE + at, mask=valid[:, None], other=0.0).to(tl.float32)
        total += tl.sum(k + v, axis=0)
    tl.store(SUMS + pid * HEAD_DIM + dims, total)


def fca_ranges(groups: int, per_group: int, prefix: int, suffix: int, chunk: int, device) -> torch.Tensor:
    """``[ranges, 3]`` (block-table row, start, end): each group's prefix once, then each request's suffix."""
    ranges = [(g * per_group, s, min(s + chunk, prefix)) for g in range(groups) for s in range(0, prefix, chunk)]
    ranges += [
        (r, s, min(s + chunk, prefix + suffix))
        for r in range(groups * per_group)
        for s in range(prefix, prefix + suffix, chunk)
    ]
    return torch.tensor(ranges, dtype=torch.int32, device=device)


def _fca_bytes_sum(batch: dict, groups: int, per_group: int, prefix: int, suffix: int) -> float:
    """The sum of every key and value FCA reads in ``batch``'s last layer, in torch: what every tiling's sums must
    add up to (each chunking covers the same positions)."""
    k_cache, v_cache = batch["caches"][-1]
    tables = batch["block_tables"]
    whole = fca_ranges(groups, per_group, prefix, suffix, prefix + suffix, "cpu").tolist()  # one range per read
    return sum(
        gather_kv(cache, tables[row], start, end).float().sum().item()
        for row, start, end in whole
        for cache in (k_cache, v_cache)
    )


def read_times_us(
    batch: dict, groups: int, per_group: int, prefix: int, suffix: int, graph_us, tilings=TILINGS
) -> dict[tuple, float]:
    """``graph_us`` times of reading ``batch``'s (``fca.paged_batch``) FCA bytes, per tiling.

    Raises if a tiling's sums differ from torch's over the same positions (the floor read the wrong bytes).
    """
    caches, tables = batch["caches"], batch["block_tables"]
    _, block_size, kv_heads, head_dim = caches[0][0].shape
    expected = _fca_bytes_sum(batch, groups, per_group, prefix, suffix)
    times = {}
    for chunk, block_n, warps in tilings:
        ranges = fca_ranges(groups, per_group, prefix, suffix, chunk, tables.device)
        grid = (len(ranges) * kv_heads,)
        sums = torch.empty(grid[0], head_dim, device=tables.device)

        def read(layer, ranges=ranges, grid=grid, sums=sums, block_n=block_n, warps=warps):
            k_cache, v_cache = caches[layer]
            _read_ranges[grid](
                k_cache, v_cache, tables, ranges, sums, *k_cache.stride()[:3], tables.stride(0),
                NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, num_warps=warps,
            )  # fmt: skip

        times[chunk, block_n, warps] = graph_us(read)  # its replays end with the last layer's sums
        got = sums.sum().item()
        # fp32 sums of millions of random values in two orders differ by rounding only; other bytes' sum would miss by
        # about the sum's own size.
        if abs(got - expected) > 1e-3 * max(1.0, abs(expected)) + 1.0:
            raise RuntimeError(f"the read floor's kernel summed {got}, torch {expected} over the same positions")
    return times


def read_floor_us(batch: dict, groups: int, per_group: int, prefix: int, suffix: int, graph_us) -> float:
    """The best time of ``read_times_us`` over ``TILINGS``: the floor ``fca.py`` prints."""
    return min(read_times_us(batch, groups, per_group, prefix, suffix, graph_us).values())


def main() -> None:
    from fca import CASES, SHAPES, graph_us, paged_batch

    # (fca imported here: when fca.py runs as a script and calls read_floor_us, it is __main__, not fca.)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen2-0.5b")
    shape = SHAPES[parser.parse_args().shape]
    print(f"device: {torch.cuda.get_device_name()}; {shape.name} attention")
    for label, groups, per_group, _ in CASES:
        batch = paged_batch(groups, per_group, 8192, 256, shape)
        nbytes = (groups * 8192 + groups * per_group * 256) * shape.kv_heads * shape.dim * 2 * 2
        print(f"[{label}: {nbytes / 1e6:.1f} MB to read]")
        times = read_times_us(batch, groups, per_group, 8192, 256, graph_us, ALL_TILINGS)
        for (chunk, block_n, warps), us in sorted(times.items(), key=lambda item: item[1]):
            print(
                f"  chunk {chunk:4d}, BLOCK_N {block_n:3d}, {warps} warps: {us:5.1f} us  {nbytes / us / 1e6:4.2f} TB/s"
            )


if __name__ == "__main__":
    main()
