"""The torch Forest Cascade Attention reference equals plain paged attention (float32, 1e-5)."""

import pytest
import torch

from arctic_rl_core.zorro.attention.forest import PrefixForest, SharedPrefix, build_forest
from arctic_rl_core.zorro.attention.reference import (
    attention_with_lse,
    cascade_attention,
    gather_kv,
    merge_attention_states,
    paged_decode_attention,
    paged_prefill_attention,
)

BS, HKV, GROUP, D = 4, 2, 3, 16
SCALE = D**-0.5


def _cache(num_blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, BS, HKV, D, generator=g), torch.randn(num_blocks, BS, HKV, D, generator=g))


def _tables(tables):
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def _queries(n, seed=1):
    return torch.randn(n, HKV * GROUP, D, generator=torch.Generator().manual_seed(seed))


FORESTS = {
    # one group of three sharing a 3-block prompt, one unrelated request; ragged suffixes
    "one_level": ([[0, 1, 2, 10], [0, 1, 2, 11, 12], [0, 1, 2, 13], [30, 31]], [14, 19, 13, 7]),
    # a system prompt for all, then two groups with their own prompt blocks
    "two_levels": (
        [[0, 1, 2, 3, 10], [0, 1, 2, 3, 11], [0, 1, 4, 5, 12, 13], [0, 1, 4, 5, 14], [0, 1, 20]],
        [17, 18, 22, 19, 9],
    ),
    # system prompt, question, first answer, then each request's own turn
    "three_levels": (
        [[0, 1, 2, 3, 20], [0, 1, 2, 3, 21, 22], [0, 1, 2, 4, 23], [0, 1, 2, 5, 24], [0, 1, 6, 25]],
        [18, 21, 17, 19, 13],
    ),
}


@pytest.mark.parametrize("name", FORESTS)
def test_cascade_equals_plain_attention_on_forests_built_from_block_tables(name):
    tables, lengths = FORESTS[name]
    forest = build_forest(tables, lengths, BS)
    assert forest.num_levels == {"one_level": 1, "two_levels": 2, "three_levels": 3}[name]
    k_cache, v_cache = _cache()
    q = _queries(len(tables))
    block_tables = _tables(tables)
    plain = paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, SCALE)
    cascade = cascade_attention(q, k_cache, v_cache, block_tables, lengths, forest, SCALE)
    torch.testing.assert_close(cascade, plain, atol=1e-5, rtol=1e-5)


def test_cascade_equals_plain_with_block_unaligned_shared_prefixes():
    # Requests 0 and 1 hold identical keys for positions 0..9 in different blocks (10 is not a block multiple);
    # the shared node reads them through request 0's table only.
    k_cache, v_cache = _cache()
    for cache in (k_cache, v_cache):
        cache[8, :2] = cache[2, :2]  # positions 8, 9 of request 1 copy request 0's
    tables = [[0, 1, 2, 5], [0, 1, 8, 9]]
    lengths = [15, 13]
    forest = PrefixForest(prefixes=(SharedPrefix(0, 10, (0, 1), source=0, depth=1),), suffix_starts=(10, 10))
    q = _queries(2)
    plain = paged_decode_attention(q, k_cache, v_cache, _tables(tables), lengths, SCALE)
    cascade = cascade_attention(q, k_cache, v_cache, _tables(tables), lengths, forest, SCALE)
    torch.testing.assert_close(cascade, plain, atol=1e-5, rtol=1e-5)


def test_batched_plain_decode_equals_each_request_attending_over_its_own_gathered_context():
    # The padded batch against the definition, one request at a time: ragged lengths, grouped-query heads.
    k_cache, v_cache = _cache()
    tables = _tables([[3, 4, 5, 6], [7], [8, 9], [0, 1, 2, 10, 11]])
    lengths = [13, 1, 8, 18]
    q = _queries(len(lengths))
    out = paged_decode_attention(q, k_cache, v_cache, tables, lengths, SCALE)
    for r, length in enumerate(lengths):
        k, v = gather_kv(k_cache, tables[r], 0, length), gather_kv(v_cache, tables[r], 0, length)
        torch.testing.assert_close(out[r], attention_with_lse(q[r : r + 1], k, v, SCALE)[0][0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("lengths", [[10, 13], [10, 10]], ids=["one suffix empty", "every suffix empty"])
def test_cascade_equals_plain_when_a_context_ends_with_its_shared_prefix(lengths):
    k_cache, v_cache = _cache()
    for cache in (k_cache, v_cache):
        cache[8, :2] = cache[2, :2]  # as above: request 1's positions 8, 9 hold request 0's keys
    tables = _tables([[0, 1, 2, 5], [0, 1, 8, 9]])
    forest = PrefixForest(prefixes=(SharedPrefix(0, 10, (0, 1), source=0, depth=1),), suffix_starts=(10, 10))
    q = _queries(2)
    plain = paged_decode_attention(q, k_cache, v_cache, tables, lengths, SCALE)
    cascade = cascade_attention(q, k_cache, v_cache, tables, lengths, forest, SCALE)
    torch.testing.assert_close(cascade, plain, atol=1e-5, rtol=1e-5)


def test_merging_partials_over_a_split_key_set_equals_attention_over_all_keys():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(5, 4, D, generator=g), torch.randn(23, 2, D, generator=g), torch.randn(23, 2, D, generator=g)
    whole, _ = attention_with_lse(q, k, v, SCALE)
    parts = [attention_with_lse(q, k[a:b], v[a:b], SCALE) for a, b in ((0, 7), (7, 8), (8, 23))]
    torch.testing.assert_close(merge_attention_states(parts), whole, atol=1e-6, rtol=1e-5)


def test_a_partial_over_no_visible_key_is_the_merge_identity():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 2, D, generator=g), torch.randn(6, 2, D, generator=g), torch.randn(6, 2, D, generator=g)
    empty = attention_with_lse(q, k, v, SCALE, query_positions=torch.tensor([-1, -1]))
    assert torch.isneginf(empty[1]).all() and (empty[0] == 0).all()
    full = attention_with_lse(q, k, v, SCALE)
    torch.testing.assert_close(merge_attention_states([full, empty]), full[0])


def test_prefill_attention_is_causal_and_continues_after_a_cached_prefix():
    k_cache, v_cache = _cache()
    tables = _tables([[3, 4, 5], [6, 7]])
    query_lens, lengths = [4, 6], [11, 6]  # request 0 has 7 cached positions
    q = _queries(sum(query_lens))
    out = paged_prefill_attention(q, k_cache, v_cache, tables, query_lens, lengths, SCALE)
    for i, (row, length) in enumerate([(0, 8), (3, 11), (4, 1), (9, 6)]):
        r = 0 if row < 4 else 1
        k = gather_kv(k_cache, tables[r], 0, length)
        v = gather_kv(v_cache, tables[r], 0, length)
        expected = attention_with_lse(q[row : row + 1], k, v, SCALE)[0][0]
        torch.testing.assert_close(out[row], expected, atol=1e-6, rtol=1e-5)
