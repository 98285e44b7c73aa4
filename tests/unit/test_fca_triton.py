"""The fused Triton attention kernel, run by Triton's interpreter on CPU, equals the torch reference.

Covers Forest Cascade decode (1-3 levels, ragged suffixes, KV split into
chunks), plain decode, and causal prefill after a cached prefix, with GQA.
The checks run in a fresh Python with ``TRITON_INTERPRET=1``
(``tests.triton_interpreter``); each test reads its result.
"""

import importlib
from functools import partial

import pytest
import torch

from arctic_rl_core.zorro.attention.forest import PrefixForest, build_forest
from arctic_rl_core.zorro.attention.plan import TileShape, plan_decode, plan_prefill
from arctic_rl_core.zorro.attention.reference import paged_decode_attention, paged_prefill_attention
from tests.triton_interpreter import check_test, report

BS, HKV, D = 4, 2, 16
SCALE = D**-0.5


def _kernel():
    return importlib.import_module("arctic_rl_core.zorro.attention.triton_attention")


def _setup(tables, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = max(48, 1 + max(max(t) for t in tables))
    k_cache = torch.randn(blocks, BS, HKV, D, generator=g)
    v_cache = torch.randn(blocks, BS, HKV, D, generator=g)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, block_tables, g


def _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles):
    device_plan = kernel.DevicePlan.from_plan(plan, "cpu")
    workspace = kernel.Workspace.allocate(plan.num_partial_rows, q.shape[1], q.shape[2], "cpu")
    out = torch.full_like(q, float("nan"))  # every row must be written
    return kernel.paged_attention(q, k_cache, v_cache, block_tables, positions, device_plan, workspace,
                                  q.shape[2] ** -0.5, tiles, out=out)  # fmt: skip


THREE_LEVELS = (
    [[0, 1, 2, 3, 20, 26], [0, 1, 2, 3, 21], [0, 1, 2, 4, 23], [0, 1, 2, 5, 24], [0, 1, 6, 25], [40, 41]],
    [22, 17, 19, 18, 14, 5],
)


def check_cascade_decode_kernel_equals_plain_attention(group, target_items, **tile_options):
    kernel = _kernel()
    tables, lengths = THREE_LEVELS
    forest = build_forest(tables, lengths, BS)
    assert forest.num_levels == 3
    k_cache, v_cache, block_tables, g = _setup(tables, group)
    q = torch.randn(len(tables), HKV * group, D, generator=g)
    # Narrow tiles of 4 rows (interpreter only; GPUs need 16) so that groups exercise both tile widths.
    tiles = TileShape(group, wide_rows=32, narrow_rows=4, **{"early_loads": False, **tile_options})
    plan = plan_decode(forest, lengths, tiles, target_items=target_items)
    assert len(plan.wide_items) > 0
    assert any(count > 1 for count in plan.narrow_items[:, 1]) or group > 1
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles)
    expected = paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_engine_attention_runs_the_kernels_plan():
    """The native engine's ``attend``, given a step's kernel plan (what its model runner builds on CUDA), launches
    the kernel with it: a cascade decode step equals plain attention."""
    from arctic_rl_core.engines.sampling.native.attention import AttentionMetadata, attend

    kernel = _kernel()
    tables, lengths = THREE_LEVELS
    k_cache, v_cache, block_tables, g = _setup(tables, 3)
    q = torch.randn(len(tables), HKV * 3, D, generator=g)
    tiles = TileShape(3, wide_rows=32, narrow_rows=4)
    plan = plan_decode(build_forest(tables, lengths, BS), lengths, tiles, target_items=64)
    assert len(plan.wide_items) > 0 and plan.num_partial_rows > 0
    meta = AttentionMetadata(
        is_prefill=False, slot_mapping=torch.full((len(tables),), -1), block_tables=block_tables,
        positions=torch.tensor([n - 1 for n in lengths], dtype=torch.int32),
        plan=kernel.DevicePlan.from_plan(plan, "cpu"), tiles=tiles, wide=True,
        workspace=kernel.Workspace.allocate(plan.num_partial_rows, q.shape[1], D, "cpu"),
    )  # fmt: skip
    expected = paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, SCALE)
    torch.testing.assert_close(attend(q, k_cache, v_cache, meta, SCALE), expected, atol=1e-5, rtol=1e-5)


def check_cascade_decode_in_16_bit_equals_plain_attention(dtype, **tile_options):
    """16-bit caches and queries: within the dtype's rounding."""
    kernel = _kernel()
    tables, lengths = THREE_LEVELS
    forest = build_forest(tables, lengths, BS)
    k_cache, v_cache, block_tables, g = _setup(tables, 3)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(len(tables), HKV * 3, D, generator=g).to(dtype)
    tiles = TileShape(3, wide_rows=32, narrow_rows=4, **tile_options)
    plan = plan_decode(forest, lengths, tiles, target_items=64)
    assert len(plan.wide_items) > 0
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles)
    expected = paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, lengths, SCALE)
    # The kernel rounds the softmax weights to the dtype before the weighted sum (as flash attention does).
    torch.testing.assert_close(out.float(), expected, atol=4e-3, rtol=4e-3)


def check_decode_plan_balanced_over_lanes_equals_plain_attention():
    """Shared prefixes cut into pieces of unequal lengths (``plan_decode``'s ``lanes``), merged exactly."""
    kernel = _kernel()
    tables, lengths, blocks = [], [], 0
    for _ in range(2):  # two prefixes of 768 positions, three members each with 70 of their own
        shared = list(range(blocks, blocks + 192))
        for i in range(3):
            tables.append(shared + list(range(blocks + 192 + 18 * i, blocks + 210 + 18 * i)))
            lengths.append(838)
        blocks += 192 + 54
    tiles = TileShape(3, wide_rows=32, narrow_rows=4)
    plan = plan_decode(build_forest(tables, lengths, BS), lengths, tiles, target_items=8, lanes=5)
    assert sorted((plan.wide_items[:, 4] - plan.wide_items[:, 3]).tolist()) == [64, 320, 384, 384, 384]
    k_cache, v_cache, block_tables, g = _setup(tables, 3)
    q = torch.randn(len(tables), HKV * 3, D, generator=g)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles)
    expected = paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_plain_decode_kernel_with_split_contexts_equals_reference():
    kernel = _kernel()
    tables = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31]]
    lengths = [73, 6]
    k_cache, v_cache, block_tables, g = _setup(tables, 2)
    q = torch.randn(2, HKV * 2, D, generator=g)
    tiles = TileShape(2)
    plan = plan_decode(PrefixForest.unshared(2), lengths, tiles, target_items=8)
    assert len(plan.merge_rows) == 2  # the long context is split in two 64-position chunks
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, torch.tensor([72, 5], dtype=torch.int32), tiles)
    expected = paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_a_decode_plan_serves_later_steps_up_to_its_capacity(target_items, **tile_options):
    """The engine reuses a step's plan while contexts grow within it: the kernel cuts each item at its query."""
    kernel = _kernel()
    tables, lengths = THREE_LEVELS
    tables = [table + [42 + i] for i, table in enumerate(tables)]  # a free block each, to grow into
    tiles = TileShape(3, wide_rows=32, narrow_rows=4, **tile_options)
    plan = plan_decode(build_forest(tables, lengths, BS), lengths, tiles, target_items=target_items)
    grown = [n + 3 for n in lengths]
    assert all(n <= room for n, room in zip(grown, plan.capacity))
    k_cache, v_cache, block_tables, g = _setup(tables, 3)
    for table, n in zip(tables, grown):  # a key or value read past a query's position poisons its output
        for pos in range(n, len(table) * BS):
            k_cache[table[pos // BS], pos % BS] = v_cache[table[pos // BS], pos % BS] = float("nan")
    q = torch.randn(len(tables), HKV * 3, D, generator=g)
    positions = torch.tensor([n - 1 for n in grown], dtype=torch.int32)
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles)
    expected = paged_decode_attention(q, k_cache, v_cache, block_tables, grown, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_prefill_kernel_is_causal_after_a_cached_prefix(long_prefix=False, **tile_options):
    kernel = _kernel()
    tables = [[3, 4, 5, 6, 7, 8], [9, 10], [11]]
    query_lens, lengths = [19, 7, 1], [23, 7, 3]  # request 0 has 4 cached positions, request 2 has 2
    if long_prefix:  # request 0's tile spans positions 51-69: two masked 64-key steps
        tables[0] = list(range(20, 38))
        lengths[0] = 70
    k_cache, v_cache, block_tables, g = _setup(tables, 3)
    q = torch.randn(sum(query_lens), HKV * 3, D, generator=g)
    positions = torch.tensor(
        [p for n, length in zip(query_lens, lengths) for p in range(length - n, length)], dtype=torch.int32
    )
    tiles = TileShape(3, **{"early_loads": False, **tile_options})
    plan = plan_prefill(query_lens, lengths, tiles)
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles)
    expected = paged_prefill_attention(q, k_cache, v_cache, block_tables, query_lens, lengths, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_decode_at_a_7b_models_attention_equals_plain_attention():
    """Qwen2.5-7B's attention (28 query heads over 4 KV heads, head dim 128) with the engine's tiles: five
    requests share eight blocks, each with a ninth of its own."""
    kernel = _kernel()
    heads, kv_heads, dim, block = 28, 4, 128, 16
    tables = [list(range(8)) + [20 + i] for i in range(5)]
    lengths = [8 * block + 5] * 5
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(40, block, kv_heads, dim, generator=g)
    v_cache = torch.randn(40, block, kv_heads, dim, generator=g)
    q = torch.randn(len(tables), heads, dim, generator=g)
    tiles = TileShape(heads // kv_heads)
    plan = plan_decode(build_forest(tables, lengths, block), lengths, tiles, target_items=8)
    assert len(plan.wide_items) == 1
    block_tables = torch.tensor(tables, dtype=torch.int32)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles)
    expected = paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_decode_with_blocks_that_do_not_divide_a_step(block_size, block_n=64, **tile_options):
    """Blocks larger than the kernel's step, or of a size that does not divide it, or than the plan's
    64-position chunk alignment, take the general path from positions to cache slots (one division per
    position)."""
    kernel = _kernel()
    # The first two share two blocks; the first's own range spans chunks that start inside a block.
    tables = [[3, 1, 4, 6, 7, 8, 9, 10, 11], [3, 1, 5], [2]]
    lengths = [9 * block_size - 5, 2 * block_size + 7, block_size - 1]
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(12, block_size, HKV, D, generator=g)
    v_cache = torch.randn(12, block_size, HKV, D, generator=g)
    block_tables = torch.tensor([t + [0] * (9 - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(tables), HKV * 3, D, generator=g)
    tiles = TileShape(3, wide_rows=32, narrow_rows=4, block_n=block_n, **tile_options)
    plan = plan_decode(build_forest(tables, lengths, block_size), lengths, tiles, target_items=64)
    assert len(plan.wide_items) > 0 and len(plan.merge_rows) > 0
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles)
    expected = paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_stale_cache_values_never_reach_the_output(**tile_options):
    """Every slot that holds no live position (block 0 and the free blocks too) is NaN, and no output may see one.

    The shared prefix is one wide unit of three 64-key steps, the last one
    partial: what lies past it is read ahead (blocks wholly past it as block
    0), and must get no weight, with its values zero (0 * NaN is NaN).
    """
    kernel = _kernel()
    prefix = list(range(1, 35))  # 136 positions: steps of 64, 64 and 8
    tables = [prefix + [35 + i] for i in range(3)]
    lengths = [len(prefix) * BS + n for n in (3, 1, 4)]
    k_cache, v_cache, block_tables, g = _setup(tables, 3)
    live = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for table, n in zip(tables, lengths):
        for pos in range(n):
            live[table[pos // BS], pos % BS] = True
    k_cache[~live] = v_cache[~live] = float("nan")
    q = torch.randn(len(tables), HKV * 3, D, generator=g)
    tiles = TileShape(3, wide_rows=32, narrow_rows=4, **tile_options)
    plan = plan_decode(build_forest(tables, lengths, BS), lengths, tiles, target_items=1)
    spans = plan.wide_items[:, 4] - plan.wide_items[:, 3]
    assert spans.tolist() == [len(prefix) * BS] and spans[0] % tiles.block_n > 0
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles)
    expected = paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_caches_whose_blocks_are_strided_views():
    """Keys and values interleaved per block (``[blocks, 2, slots, heads, dim]``, as some engines lay them out)."""
    kernel = _kernel()
    tables, lengths = THREE_LEVELS
    _, _, block_tables, g = _setup(tables, 3)
    both = torch.randn(48, 2, BS, HKV, D, generator=g)
    k_cache, v_cache = both[:, 0], both[:, 1]
    q = torch.randn(len(tables), HKV * 3, D, generator=g)
    tiles = TileShape(3, wide_rows=32, narrow_rows=4)
    plan = plan_decode(build_forest(tables, lengths, BS), lengths, tiles, target_items=64)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    out = _run(kernel, plan, q, k_cache, v_cache, block_tables, positions, tiles)
    expected = paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


CHECKS = {
    # target_items 64: contexts split into 64-position chunks, then merged
    **{
        f"cascade_decode[group={g},target={t}]": (check_cascade_decode_kernel_equals_plain_attention, (g, t))
        for g in (1, 3)
        for t in (1, 64)
    },  # fmt: skip
    # fp16 only: the interpreter computes bf16 wrongly (the old kernel too); the GPU tests run bf16.
    "cascade_decode[fp16]": (check_cascade_decode_in_16_bit_equals_plain_attention, (torch.float16,)),
    "plain_decode_split": (check_plain_decode_kernel_with_split_contexts_equals_reference, ()),
    "decode_balanced_lanes": (check_decode_plan_balanced_over_lanes_equals_plain_attention, ()),
    **{
        f"decode_plan_reused[target={t}]": (check_a_decode_plan_serves_later_steps_up_to_its_capacity, (t,))
        for t in (1, 64)
    },
    "prefill_causal": (check_prefill_kernel_is_causal_after_a_cached_prefix, ()),
    "prefill_causal[long_prefix]": (
        partial(check_prefill_kernel_is_causal_after_a_cached_prefix, early_loads=True),
        (True,),
    ),
    **{f"decode_blocks_of_{n}": (check_decode_with_blocks_that_do_not_divide_a_step, (n,)) for n in (12, 128)},
    # 128-position steps over 128-position blocks: the step divides by the block, but chunks start at 64s.
    "decode_blocks_of_128[block_n=128]": (check_decode_with_blocks_that_do_not_divide_a_step, (128, 128)),
    # A program's first unit reads its plan and positions before it would wait for the kernel before.
    "cascade_decode[early_loads]": (
        partial(check_cascade_decode_kernel_equals_plain_attention, early_loads=True),
        (3, 64),
    ),
    "prefill_causal[early_loads]": (
        partial(check_prefill_kernel_is_causal_after_a_cached_prefix, early_loads=True),
        (),
    ),
    # Wide tiles in Triton's shallower pipeline (below 5 stages a step's keys are copied one step ahead).
    "cascade_decode[wide_stages=3]": (
        partial(check_cascade_decode_kernel_equals_plain_attention, wide_stages=3),
        (3, 64),
    ),
    "stale_cache": (check_stale_cache_values_never_reach_the_output, ()),
    "engine_attend": (check_engine_attention_runs_the_kernels_plan, ()),
    # 64-bit cache offsets (int32_offsets=False: what caches of 2**31 values or more take).
    **{
        name: (partial(check, int32_offsets=False), args)
        for name, check, args in (
            ("cascade_decode[int64]", check_cascade_decode_kernel_equals_plain_attention, (3, 64)),
            ("cascade_decode[fp16,int64]", check_cascade_decode_in_16_bit_equals_plain_attention, (torch.float16,)),
            ("prefill_causal[long_prefix,int64]", check_prefill_kernel_is_causal_after_a_cached_prefix, (True,)),
            ("decode_blocks_of_12[int64]", check_decode_with_blocks_that_do_not_divide_a_step, (12,)),
        )
    },
    "cache_blocks_not_outermost": (check_caches_whose_blocks_are_strided_views, ()),
    "decode_qwen2.5_7b_attention": (check_decode_at_a_7b_models_attention_equals_plain_attention, ()),
}


test_kernel_under_the_interpreter = check_test(__file__, CHECKS)


@pytest.mark.parametrize(
    "case, message",
    [
        ("scale", "scale must be positive"),
        ("strides", "one layout for both caches"),
        ("head_dim", "power of two of at least 16, got 24"),
    ],
)
def test_paged_attention_names_what_it_needs_of_its_inputs(case, message):
    kernel = _kernel()
    tables, lengths = THREE_LEVELS
    k_cache, v_cache, block_tables, g = _setup(tables, 1)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    if case == "strides":
        v_cache = v_cache.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, blocks not outermost
    if case == "head_dim":  # 24 dims: no tile spans them
        k_cache = torch.zeros(48, BS, HKV, 24, dtype=torch.half)
        v_cache = torch.zeros(48, BS, HKV, 24, dtype=torch.half)
    q = torch.randn(len(tables), HKV, k_cache.shape[-1], generator=g).half()
    tiles = TileShape(1, wide_rows=32, narrow_rows=4)
    plan = plan_decode(build_forest(tables, lengths, BS), lengths, tiles, target_items=1)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    device_plan = kernel.DevicePlan.from_plan(plan, "cpu")
    workspace = kernel.Workspace.allocate(plan.num_partial_rows, HKV, D, "cpu")
    with pytest.raises(ValueError, match=message):
        kernel.paged_attention(q, k_cache, v_cache, block_tables, positions, device_plan, workspace,
                               0.0 if case == "scale" else SCALE, tiles)  # fmt: skip


def test_32_bit_offsets_only_where_they_reach_every_cache_value():
    kernel = _kernel()
    assert kernel.fits_int32_offsets(torch.empty(2**16, 16, 16, 128, device="meta"))  # 2**31 values: offsets fit
    assert not kernel.fits_int32_offsets(torch.empty(2**17, 16, 16, 128, device="meta"))
    # A view of 2**30 values whose last is 2**32 - 2**17 + 2**15 - 1 values after its first.
    assert not kernel.fits_int32_offsets(torch.empty(2**15, 4, 16, 16, 128, device="meta")[:, 0])
    tiles = TileShape(7, int32_offsets=True)
    options = [kernel.kernel_options(tiles, 14, 2, 64, 16, torch.bfloat16, True, True, fits)["INT32_OFFSETS"]
               for fits in (True, False)]  # fmt: skip
    assert options == [True, False]


if __name__ == "__main__":
    report(CHECKS)
