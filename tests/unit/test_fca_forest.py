"""Prefix forests from block tables: which requests share which KV positions."""

import pytest

from arctic_rl_core.zorro.attention.forest import PrefixForest, build_forest

BS = 4


def _spans(forest: PrefixForest) -> set[tuple[int, int, tuple[int, ...]]]:
    return {(p.start, p.end, p.members) for p in forest.prefixes}


def test_requests_sharing_prompt_blocks_form_one_group_and_keep_their_own_suffix():
    tables = [[0, 1, 2, 10], [0, 1, 2, 11], [0, 1, 2, 12], [7, 8]]
    forest = build_forest(tables, [15, 14, 13, 6], BS)
    assert _spans(forest) == {(0, 12, (0, 1, 2))}
    assert forest.suffix_starts == (12, 12, 12, 0)
    assert forest.num_levels == 1


def test_system_prompt_then_prompt_then_turn_gives_three_levels():
    # blocks 0-1: system prompt (all); 2: question (0-3); 3: first answer (0-1); then each request's own.
    tables = [[0, 1, 2, 3, 20], [0, 1, 2, 3, 21], [0, 1, 2, 4, 22], [0, 1, 2, 5, 23], [0, 1, 6, 24]]
    forest = build_forest(tables, [18, 18, 17, 19, 13], BS)
    assert _spans(forest) == {(0, 8, (0, 1, 2, 3, 4)), (8, 12, (0, 1, 2, 3)), (12, 16, (0, 1))}
    assert forest.num_levels == 3
    assert forest.suffix_starts == (16, 16, 12, 12, 8)
    depth = {p.members: p.depth for p in forest.prefixes}
    assert depth[(0, 1, 2, 3, 4)] == 1 and depth[(0, 1, 2, 3)] == 2 and depth[(0, 1)] == 3


def test_a_block_not_full_for_every_member_is_not_shared():
    # Request 1's context ends inside block 1, so only block 0 is shared.
    tables = [[0, 1, 5], [0, 1]]
    forest = build_forest(tables, [10, 6], BS)
    assert _spans(forest) == {(0, 4, (0, 1))}
    assert forest.suffix_starts == (4, 4)


def test_short_shared_runs_fold_into_their_children():
    tables = [[0, 1, 2, 9], [0, 1, 2, 8], [0, 3, 4, 7], [0, 3, 4, 6]]
    forest = build_forest(tables, [16] * 4, BS, min_shared_blocks=2)
    # Block 0 alone (shared by all) is too short: each pair's node then starts at position 0.
    assert _spans(forest) == {(0, 12, (0, 1)), (0, 12, (2, 3))}
    assert forest.num_levels == 1


def test_no_sharing_gives_an_empty_forest_and_full_suffixes():
    forest = build_forest([[0, 1], [2, 3], [4]], [7, 8, 2], BS)
    assert not forest.has_sharing
    assert forest.suffix_starts == (0, 0, 0)
    assert build_forest([], [], BS) == PrefixForest.unshared(0)


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="context_lens"):
        build_forest([[0]], [1, 2], BS)
