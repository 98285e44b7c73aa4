"""The compiled Triton attention kernel on CUDA equals the torch reference, eagerly and under graph replay."""

import pytest
import torch

from arctic_rl_core.zorro.attention.forest import PrefixForest, build_forest
from arctic_rl_core.zorro.attention.plan import ROWS_128, TileShape, plan_decode, plan_prefill
from arctic_rl_core.zorro.attention.reference import paged_decode_attention, paged_prefill_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BS, HKV, D = 16, 2, 64
GROUP = 7


def _cache(dtype, blocks=4096, seed=0, kv_heads=HKV, dim=D):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(blocks, BS, kv_heads, dim, generator=g, device="cuda").to(dtype) for _ in range(2))


def _forest_batch(prefix_blocks=40, groups=3, per_group=5, suffix_tokens=(33, 90, 7, 150, 64)):
    """``groups`` groups under one shared system prompt (2 levels), ragged suffixes, plus one loner."""
    tables, lengths, next_block = [], [], prefix_blocks * groups + 8
    for g in range(groups):
        prompt = list(range(4)) + list(range(4 + g * prefix_blocks, 4 + (g + 1) * prefix_blocks))
        for r in range(per_group):
            n = suffix_tokens[r % len(suffix_tokens)]
            own = list(range(next_block, next_block + -(-n // BS)))
            next_block += len(own)
            tables.append(prompt + own)
            lengths.append(len(prompt) * BS + n)
    tables.append(list(range(next_block, next_block + 30)))
    lengths.append(30 * BS - 3)
    return tables, lengths


def _run(q, caches, tables, lengths, plan, positions, tiles):
    from arctic_rl_core.zorro.attention import triton_attention as kernel

    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    device_plan = kernel.DevicePlan.from_plan(plan, "cuda")
    workspace = kernel.Workspace.allocate(plan.num_partial_rows, q.shape[1], q.shape[2], "cuda")
    out = kernel.paged_attention(q, *caches, block_tables, positions, device_plan, workspace, q.shape[2] ** -0.5, tiles)
    return out, block_tables


# The defaults (64-row tiles of up to 9 requests, early loads, Triton's pipelining), 128-row tiles (a group of 16
# requests in one), every load after the wait, and 64-bit cache offsets (what caches of 2**31 values or more take).
TILES = [
    TileShape(GROUP),
    TileShape(GROUP, **ROWS_128),
    TileShape(GROUP, early_loads=False),
    TileShape(GROUP, int32_offsets=False),
]


def _tiles_id(tiles: TileShape) -> str:
    return f"{tiles.wide_rows}rows{'-early' if tiles.early_loads else ''}{'' if tiles.int32_offsets else '-int64'}"


@pytest.mark.parametrize("tiles", TILES, ids=_tiles_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_forest", [True, False])
def test_decode_kernel_equals_reference(dtype, use_forest, tiles):
    tables, lengths = _forest_batch(per_group=16)
    forest = build_forest(tables, lengths, BS) if use_forest else PrefixForest.unshared(len(tables))
    assert forest.num_levels == (2 if use_forest else 0)
    caches = _cache(dtype)
    q = torch.randn(len(tables), HKV * GROUP, D, device="cuda").to(dtype)
    plan = plan_decode(forest, lengths, tiles, target_items=264)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device="cuda")
    out, block_tables = _run(q, caches, tables, lengths, plan, positions, tiles)
    expected = paged_decode_attention(q.float(), caches[0].float(), caches[1].float(), block_tables, lengths, D**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("tiles", TILES[:2], ids=_tiles_id)
def test_decode_plan_balanced_over_the_kernels_lanes_equals_reference(tiles):
    """The engine's plans once the kernel is built: shared prefixes cut to even out its programs' work."""
    from arctic_rl_core.zorro.attention import triton_attention as kernel

    tables, lengths = _forest_batch(prefix_blocks=512, groups=4, per_group=16, suffix_tokens=(256,))
    forest = build_forest(tables, lengths, BS)
    caches = _cache(torch.bfloat16)
    q = torch.randn(len(tables), HKV * GROUP, D, device="cuda").to(torch.bfloat16)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device="cuda")
    _run(q, caches, tables, lengths, plan_decode(forest, lengths, tiles, target_items=264), positions, tiles)
    lanes = kernel.plan_lanes(HKV * GROUP, *caches, tiles, torch.bfloat16)
    assert lanes is not None and lanes >= torch.cuda.get_device_properties(0).multi_processor_count // HKV
    plan = plan_decode(forest, lengths, tiles, target_items=264, lanes=lanes)
    assert len(set((plan.wide_items[:, 4] - plan.wide_items[:, 3]).tolist())) > 1  # pieces of several lengths
    out, block_tables = _run(q, caches, tables, lengths, plan, positions, tiles)
    expected = paged_decode_attention(q.float(), caches[0].float(), caches[1].float(), block_tables, lengths, D**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tiles", TILES, ids=_tiles_id)
def test_stale_cache_slots_never_reach_the_output(tiles):
    """Every slot that holds no live position (block 0 and the free blocks too) is NaN: no output may see one."""
    tables, lengths = _forest_batch(per_group=16)
    tables = [[block + 1 for block in table] for table in tables]  # block 0 free: blocks past a range read it
    caches = _cache(torch.bfloat16)
    live = torch.zeros(caches[0].shape[:2], dtype=torch.bool, device="cuda")
    for table, n in zip(tables, lengths):
        positions = torch.arange(n, device="cuda")
        live[torch.tensor(table, device="cuda")[positions // BS], positions % BS] = True
    assert not live[0].any()
    for cache in caches:
        cache[~live] = float("nan")
    q = torch.randn(len(tables), HKV * GROUP, D, device="cuda").to(torch.bfloat16)
    plan = plan_decode(build_forest(tables, lengths, BS), lengths, tiles, target_items=264)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device="cuda")
    out, block_tables = _run(q, caches, tables, lengths, plan, positions, tiles)
    expected = paged_decode_attention(q.float(), caches[0].float(), caches[1].float(), block_tables, lengths, D**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tiles", TILES, ids=_tiles_id)
def test_prefill_kernel_equals_reference(tiles):
    caches = _cache(torch.bfloat16)
    tables = [list(range(0, 70)), list(range(100, 103)), list(range(200, 260))]
    query_lens, lengths = [1100, 40, 1], [1100, 40, 950]
    q = torch.randn(sum(query_lens), HKV * GROUP, D, device="cuda").to(torch.bfloat16)
    positions = [p for n, length in zip(query_lens, lengths) for p in range(length - n, length)]
    positions = torch.tensor(positions, dtype=torch.int32, device="cuda")
    out, block_tables = _run(q, caches, tables, lengths, plan_prefill(query_lens, lengths, tiles), positions, tiles)
    expected = paged_prefill_attention(q.float(), caches[0].float(), caches[1].float(), block_tables, query_lens,
                                       lengths, D**-0.5)  # fmt: skip
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


# Larger models' attention: Qwen2.5-7B (28 heads, 4 KV heads, dim 128), Llama-3-8B (32/8/128: a group of 16
# requests in one 64-row tile), Qwen3-0.6B (16/8/128).
@pytest.mark.parametrize("heads, kv_heads, dim", [(28, 4, 128), (32, 8, 128), (16, 8, 128)])
def test_decode_and_prefill_at_other_models_attention_equal_reference(heads, kv_heads, dim):
    tiles = TileShape(heads // kv_heads)
    caches = _cache(torch.bfloat16, kv_heads=kv_heads, dim=dim)
    k_ref, v_ref = caches[0].float(), caches[1].float()
    tables, lengths = _forest_batch(per_group=16)
    q = torch.randn(len(tables), heads, dim, device="cuda").to(torch.bfloat16)
    plan = plan_decode(build_forest(tables, lengths, BS), lengths, tiles, target_items=264)
    assert len(plan.wide_items) > 0
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device="cuda")
    out, block_tables = _run(q, caches, tables, lengths, plan, positions, tiles)
    expected = paged_decode_attention(q.float(), k_ref, v_ref, block_tables, lengths, dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)

    tables = [list(range(0, 70)), list(range(100, 103))]
    query_lens, lengths = [1100, 40], [1100, 40]
    q = torch.randn(sum(query_lens), heads, dim, device="cuda").to(torch.bfloat16)
    positions = [p for n, length in zip(query_lens, lengths) for p in range(length - n, length)]
    positions = torch.tensor(positions, dtype=torch.int32, device="cuda")
    plan = plan_prefill(query_lens, lengths, tiles)
    out, block_tables = _run(q, caches, tables, lengths, plan, positions, tiles)
    expected = paged_prefill_attention(q.float(), k_ref, v_ref, block_tables, query_lens, lengths, dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_graph_replay_follows_the_plan_written_into_static_buffers():
    from arctic_rl_core.zorro.attention import triton_attention as kernel

    tables, lengths = _forest_batch()
    n = len(tables)
    caches = _cache(torch.bfloat16)
    tiles = TileShape(GROUP)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    static = kernel.DevicePlan.empty(max_items=512, max_query_refs=2048, max_queries=n, max_partial_rows=2048,
                                     device="cuda")  # fmt: skip
    workspace = kernel.Workspace.allocate(2048, HKV * GROUP, D, "cuda")
    q = torch.randn(n, HKV * GROUP, D, device="cuda").to(torch.bfloat16)
    positions = torch.zeros(n, dtype=torch.int32, device="cuda")

    def load(plan, lens):
        for name in ("wide_items", "narrow_items"):
            getattr(static, name)[: len(getattr(plan, name))] = torch.from_numpy(getattr(plan, name))
        static.counts.copy_(torch.tensor([len(plan.wide_items), len(plan.narrow_items)]))
        static.query_index[: len(plan.query_index)] = torch.from_numpy(plan.query_index)
        static.merge_offsets.copy_(torch.from_numpy(plan.merge_offsets))
        static.merge_rows[: len(plan.merge_rows)] = torch.from_numpy(plan.merge_rows)
        positions.copy_(torch.tensor([x - 1 for x in lens]))

    forest = build_forest(tables, lengths, BS)
    load(plan_decode(forest, lengths, tiles, 264), lengths)
    out = torch.empty_like(q)

    def run():
        kernel.paged_attention(q, *caches, block_tables, positions, static, workspace, D**-0.5, tiles, out=out)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for shrink in (0, 5):  # a later step: other lengths, another plan, same graph
        lens = [x - shrink for x in lengths]
        load(plan_decode(forest, lens, tiles, 264), lens)
        graph.replay()
        expected = paged_decode_attention(q.float(), caches[0].float(), caches[1].float(), block_tables, lens, D**-0.5)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_attention_and_merge_kernels_ask_for_one_shared_memory_carveout():
    """Programs of kernels with different carveouts do not share a multiprocessor, so the merge, launched early as a
    dependent, asks for the attention kernel's (``SHARED_CARVEOUT``): read back from the driver for every build."""
    import ctypes

    from arctic_rl_core.zorro.attention import triton_attention as kernel

    tables, lengths = _forest_batch()
    forest = build_forest(tables, lengths, BS)
    tiles = TileShape(GROUP)
    q = torch.randn(len(tables), HKV * GROUP, D, device="cuda").to(torch.bfloat16)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32, device="cuda")
    _run(q, _cache(torch.bfloat16), tables, lengths, plan_decode(forest, lengths, tiles, 264), positions, tiles)
    torch.cuda.synchronize()
    for jit in (kernel._attend_items, kernel._merge_partials):
        builds = [b for caches in jit.device_caches.values() for b in caches[0].values()]
        assert builds, f"{jit.__name__} was never built"
        for build in builds:
            value = ctypes.c_int(-1)
            attribute = kernel._CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            status = kernel._libcuda().cuFuncGetAttribute(
                ctypes.byref(value), attribute, ctypes.c_void_p(build.function)
            )
            assert status == 0 and value.value == kernel.SHARED_CARVEOUT, (jit.__name__, status, value.value)
