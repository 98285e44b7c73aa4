"""Kernel work plans: every query reads each of its KV positions exactly once, through the right block table."""

import numpy as np
import pytest

from arctic_rl_core.zorro.attention.forest import PrefixForest, build_forest
from arctic_rl_core.zorro.attention.plan import (
    DIRECT,
    ITEM_COST,
    KV_ALIGN,
    KV_END,
    KV_START,
    PARTIAL_ROW,
    QUERY_COUNT,
    QUERY_OFFSET,
    TABLE_ROW,
    TileShape,
    decode_buffer_sizes,
    plan_decode,
    plan_prefill,
)

BS = 4
TABLES = [[0, 1, 2, 3, 20], [0, 1, 2, 3, 21, 22], [0, 1, 2, 4, 23], [0, 1, 2, 5, 24], [0, 1, 6, 25], [40, 41]]
LENGTHS = [18, 21, 17, 19, 13, 6]


def _coverage(plan, lengths, tables=TABLES):
    """Per query: the sorted (table row's block, position) pairs it reads (the kernel stops at its length)."""
    seen = [[] for _ in lengths]
    for item in np.concatenate([plan.wide_items, plan.narrow_items]):
        queries = plan.query_index[item[QUERY_OFFSET] : item[QUERY_OFFSET] + item[QUERY_COUNT]]
        for i, q in enumerate(queries):
            for pos in range(item[KV_START], min(item[KV_END], lengths[q])):
                seen[q].append((tables[item[TABLE_ROW]][pos // BS], pos))
            if item[PARTIAL_ROW] != DIRECT:
                lo, hi = plan.merge_offsets[q], plan.merge_offsets[q + 1]
                assert item[PARTIAL_ROW] + i in plan.merge_rows[lo:hi]
    return [sorted(s) for s in seen]


@pytest.mark.parametrize("target_items", [1, 16, 200])
def test_decode_plan_reads_each_position_once_through_a_table_that_holds_it(target_items):
    forest = build_forest(TABLES, LENGTHS, BS)
    plan = plan_decode(forest, LENGTHS, TileShape(3), target_items=target_items)
    for q, reads in enumerate(_coverage(plan, LENGTHS)):
        assert reads == [(TABLES[q][pos // BS], pos) for pos in range(LENGTHS[q])]


@pytest.mark.parametrize("target_items", [1, 16, 200])
def test_a_decode_plan_covers_each_context_grown_up_to_its_capacity_and_no_further(target_items):
    tables = [table + [50 + i] * 30 for i, table in enumerate(TABLES)]  # blocks enough to grow into
    plan = plan_decode(build_forest(TABLES, LENGTHS, BS), LENGTHS, TileShape(3), target_items=target_items)
    assert (plan.capacity >= LENGTHS).all()
    # Each suffix's last chunk has the chunk's full length; a query with no suffix item (its whole
    # context shared, here none) would have no room.
    assert (plan.capacity > LENGTHS).any()
    for q, reads in enumerate(_coverage(plan, plan.capacity, tables)):
        assert reads == [(tables[q][pos // BS], pos) for pos in range(plan.capacity[q])]
    # One past it, a position no item covers: the engine plans anew.
    for q, reads in enumerate(_coverage(plan, plan.capacity + 1, tables)):
        assert len(reads) == plan.capacity[q]


def test_a_tight_capacity_grows_the_chunks_until_the_plan_fits():
    forest = PrefixForest.unshared(3)
    lengths = [640, 640, 600]
    loose = plan_decode(forest, lengths, TileShape(3), target_items=200)
    tight = plan_decode(forest, lengths, TileShape(3), target_items=200, max_items=12, max_partial_rows=40)
    assert loose.num_items > 12 >= tight.num_items and tight.num_partial_rows <= 40
    with pytest.raises(ValueError, match="capacity"):
        plan_decode(forest, lengths, TileShape(3), target_items=200, max_items=2)


def test_prefill_plan_writes_directly_and_covers_each_query_up_to_its_position():
    query_lens, lengths = [19, 7, 1], [23, 7, 3]
    plan = plan_prefill(query_lens, lengths, TileShape(7))
    assert (plan.wide_items[:, PARTIAL_ROW] == DIRECT).all() and (plan.narrow_items[:, PARTIAL_ROW] == DIRECT).all()
    covered = np.zeros(sum(query_lens), dtype=int)
    for item in np.concatenate([plan.wide_items, plan.narrow_items]):
        queries = plan.query_index[item[QUERY_OFFSET] : item[QUERY_OFFSET] + item[QUERY_COUNT]]
        covered[queries] += 1
        assert item[KV_START] == 0
    assert (covered == 1).all()


def test_items_run_longest_first_by_what_they_read_now_not_by_their_room():
    lengths = np.array([600, 640, 640])  # 64-position chunks: the first context ends 24 positions into its last
    plan = plan_decode(PrefixForest.unshared(3), lengths, TileShape(3), target_items=200)
    items = plan.narrow_items
    reads = np.minimum(items[:, KV_END], lengths[items[:, TABLE_ROW]]) - items[:, KV_START]
    assert (items[:, KV_END] > lengths[items[:, TABLE_ROW]]).any()  # that item has room for 40 more
    assert (np.diff(reads) <= 0).all() and reads[-1] == 24


def test_contexts_split_into_at_most_the_target_number_of_items():
    # 16 x 8193 / 264 rounds to 512-position chunks, 17 per context: 272 items, over the target.
    plan = plan_decode(PrefixForest.unshared(16), [8193] * 16, TileShape(7), target_items=264)
    assert 0.8 * 264 <= plan.num_items <= 264


def test_multi_query_items_end_by_their_last_query_so_the_kernel_loads_them_uncut():
    # The kernel starts a wide tile's first key load before its query positions arrive: only single-query
    # (suffix) items may run past their queries, into room for later steps.
    forest = build_forest(TABLES, LENGTHS, BS)
    decode = plan_decode(forest, LENGTHS, TileShape(7), target_items=16)
    assert len(decode.wide_items) > 0
    positions = np.array(LENGTHS) - 1
    query_lens, contexts = [19, 7, 1], [23, 7, 3]
    prefill = plan_prefill(query_lens, contexts, TileShape(7))
    assert len(prefill.wide_items) > 0
    prefill_positions = np.concatenate([np.arange(c - n, c) for n, c in zip(query_lens, contexts)])
    for plan, pos in ((decode, positions), (prefill, prefill_positions)):
        for item in np.concatenate([plan.wide_items, plan.narrow_items]):
            queries = plan.query_index[item[QUERY_OFFSET] : item[QUERY_OFFSET] + item[QUERY_COUNT]]
            if len(queries) > 1:
                assert item[KV_END] <= pos[queries].max() + 1


@pytest.mark.parametrize("target_items", [1, 16, 200])
def test_every_item_starts_at_a_block_so_the_kernel_finds_a_steps_blocks_without_dividing(target_items):
    # The kernel takes position kv0 + i of a step to be in block kv0 // BS + i // BS when BS divides its
    # step: true when every item starts at a multiple of the block size (of KV_ALIGN, for larger blocks).
    decode = plan_decode(build_forest(TABLES, LENGTHS, BS), LENGTHS, TileShape(3), target_items=target_items)
    prefill = plan_prefill([19, 7, 1], [23, 7, 3], TileShape(3))
    for plan in (decode, prefill):
        items = np.concatenate([plan.wide_items, plan.narrow_items])
        assert (items[:, KV_START] % min(BS, KV_ALIGN) == 0).all()


def _shared_tables(prefixes) -> tuple[list[list[int]], list[int]]:
    """Block tables and lengths: for each ``(prefix, suffixes)``, a prefix of that many positions shared by one request
    per suffix length, each suffix in blocks of its own."""
    tables, lengths, blocks = [], [], 0
    for prefix, suffixes in prefixes:
        shared = list(range(blocks, blocks + prefix // BS))
        blocks += len(shared)
        for suffix in suffixes:
            tables.append(shared + list(range(blocks, blocks + -(-suffix // BS))))
            blocks += -(-suffix // BS)
            lengths.append(prefix + suffix)
    return tables, lengths


def _groups(groups: int, members: int, prefix: int, suffix: int) -> tuple[list[list[int]], list[int]]:
    """Block tables and lengths of ``groups`` prefixes of ``prefix`` positions, each shared by ``members``."""
    return _shared_tables([(prefix, [suffix] * members)] * groups)


def _same_plan(a, b):
    for field in ("wide_items", "narrow_items", "merge_rows", "capacity"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def _longest_lane(plan, lengths, lanes):
    """Steps (plus ``ITEM_COST`` per item) of the busiest lane, as the kernel runs items: lane ``i % lanes`` takes item i."""
    items = np.concatenate([plan.wide_items, plan.narrow_items])
    ends = np.where(items[:, QUERY_COUNT] == 1, np.minimum(items[:, KV_END], np.asarray(lengths)[items[:, TABLE_ROW]]),
                    items[:, KV_END])  # fmt: skip
    steps = -(-(ends - items[:, KV_START]) // KV_ALIGN) + ITEM_COST
    return np.bincount(np.arange(len(items)) % lanes, weights=steps, minlength=lanes).max()


def test_lanes_cut_shared_prefixes_so_that_no_program_runs_much_longer_than_the_rest():
    # 4 groups of 16 (two wide tiles each): uniform chunks leave some lanes two wide items.
    tables, lengths = _groups(4, 16, 1024, 64)
    forest = build_forest(tables, lengths, BS)
    uniform = plan_decode(forest, lengths, TileShape(7), target_items=40)
    balanced = plan_decode(forest, lengths, TileShape(7), target_items=40, lanes=20)
    # Each item's fixed cost (ITEM_COST) is paid however the prefixes are cut: the cut evens out the reads.
    assert _longest_lane(balanced, lengths, 20) <= _longest_lane(uniform, lengths, 20) - 7
    assert len(np.unique(balanced.wide_items[:, KV_END] - balanced.wide_items[:, KV_START])) > 1
    for q, reads in enumerate(_coverage(balanced, lengths, tables)):
        assert reads == [(tables[q][pos // BS], pos) for pos in range(lengths[q])]
    assert (np.concatenate([balanced.wide_items, balanced.narrow_items])[:, KV_START] % BS == 0).all()


def test_lanes_leave_a_plan_as_it_is_where_they_would_not_shorten_its_longest_lane():
    # One wave of uniform chunks already: every lane has at most one item.
    tables, lengths = _groups(1, 3, 256, 10)
    forest = build_forest(tables, lengths, BS)
    uniform = plan_decode(forest, lengths, TileShape(7), target_items=6)
    balanced = plan_decode(forest, lengths, TileShape(7), target_items=6, lanes=3)
    _same_plan(balanced, uniform)


def test_a_lane_balanced_cut_that_exceeds_the_buffers_gives_way_to_even_chunks_instead_of_failing():
    # The cut gives every lane a piece of a shared prefix however long the chunks grow: where its partial rows
    # exceed the buffers, the even chunks that fit are planned (this raised "even unsplit" before).
    tables, lengths = _groups(4, 16, 1024, 64)
    forest = build_forest(tables, lengths, BS)
    uniform = plan_decode(forest, lengths, TileShape(7), target_items=40)
    balanced = plan_decode(forest, lengths, TileShape(7), target_items=40, lanes=20)
    assert balanced.num_partial_rows > uniform.num_partial_rows
    tight = plan_decode(forest, lengths, TileShape(7), target_items=40, max_partial_rows=uniform.num_partial_rows,
                        lanes=20)  # fmt: skip
    _same_plan(tight, uniform)
    for q, reads in enumerate(_coverage(tight, lengths, tables)):
        assert reads == [(tables[q][pos // BS], pos) for pos in range(lengths[q])]


@pytest.mark.parametrize(
    "group, kv_heads, groups, members, prefix",
    [
        (7, 2, 1, 27, 32768),  # Qwen2-0.5B's attention: 27 requests over a 32K prompt
        (7, 2, 3, 9, 32768),
        (7, 2, 4, 16, 8192),
        (4, 8, 1, 16, 8192),  # Llama-3-8B's: G=16 over an 8K prompt
        (4, 8, 4, 16, 8192),
    ],
)
def test_the_engines_buffers_hold_the_lane_balanced_cut(group, kv_heads, groups, members, prefix):
    """The native engine sizes its decode buffers with ``decode_buffer_sizes``: there the plan of each batch, on an H100
    (132 SMs, two programs of the attention kernel per SM), is the one planned without limits. (With the sizes before
    it, 4 * requests + 4 * target partial rows, all but the 4 x 16 one raised "even unsplit" from the engine's step.)"""
    target, lanes = 4 * 132 // kv_heads, 2 * 132 // kv_heads  # as the engine and its kernel build count them
    tables, lengths = _groups(groups, members, prefix, 40)
    forest = build_forest(tables, lengths, BS)
    tiles = TileShape(group)
    unbounded = plan_decode(forest, lengths, tiles, target, lanes=lanes)
    max_items, max_rows = decode_buffer_sizes(len(lengths), target, tiles)
    _same_plan(plan_decode(forest, lengths, tiles, target, max_items, max_rows, lanes), unbounded)


@pytest.mark.parametrize("seed", range(8))
def test_decode_plans_fit_the_engines_buffers_and_read_every_position_once(seed):
    """Random forests on a small device (so that prefixes span many lanes' pieces), sized as the engine sizes them:
    every plan fits, balanced or not, and each query reads each of its positions exactly once."""
    rng = np.random.default_rng(seed)
    group = int(rng.choice([1, 2, 4, 7, 8]))
    kv_heads = int(rng.choice([1, 2, 8]))
    target = max(32, 4 * 16 // kv_heads)  # 16 SMs
    lanes = max(16 * int(rng.choice([2, 4])) // kv_heads, 1)
    tables, lengths = _shared_tables(
        (int(rng.choice([64, 1024, 4096])), rng.integers(1, 200, size=int(rng.integers(1, 24))).tolist())
        for _ in range(int(rng.integers(1, 4)))
    )
    tiles = TileShape(group)
    max_items, max_rows = decode_buffer_sizes(len(lengths), target, tiles)
    plan = plan_decode(build_forest(tables, lengths, BS), lengths, tiles, target, max_items, max_rows, lanes)
    assert plan.num_items <= max_items and plan.num_partial_rows <= max_rows
    for q, reads in enumerate(_coverage(plan, lengths, tables)):
        assert reads == [(tables[q][pos // BS], pos) for pos in range(lengths[q])]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(group=0), r"query heads per KV head must be in \[1, 16\], got 0"),
        (dict(group=7, wide_stages=0), r"stages and wide_stages: expected pipeline depths of at least 1, got 2 and 0"),
        (dict(group=7, stages=0), r"stages and wide_stages: .* got 0 and 5"),
    ],
)
def test_tile_shapes_refuse_what_the_kernel_cannot_build_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        TileShape(**fields)
