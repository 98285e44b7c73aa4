"""The prefix forest of a batch: which tokens are shared, how they are packed, and who sees whom."""

import pytest
import torch

from arctic_rl_core.zorro.train import build_prefix_forest
from tests.prompt_rows import padded


def unpacked_rows(input_ids, attention_mask, select) -> list[tuple[int, int]]:
    """(token, position) of each selected position's full context, row by row, the naive way."""
    out = []
    for b in range(input_ids.shape[0]):
        tokens = input_ids[b][attention_mask[b].bool()].tolist()
        for t in select[b][attention_mask[b].bool()].nonzero().flatten().tolist():
            out.append([(tok, pos) for pos, tok in enumerate(tokens[: t + 1])])
    return out


def packed_contexts(forest) -> list[list[tuple[int, int]]]:
    """What each selected packed token attends to, read back from the forest's pattern."""
    q = torch.arange(len(forest.token_ids))[:, None]
    k = torch.arange(len(forest.token_ids))[None, :]
    visible = (k <= q) & (q < forest.subtree_end[None, :])
    out = []
    for i in forest.select_index.tolist():
        keys = visible[i].nonzero().flatten().tolist()
        out.append(sorted(((int(forest.token_ids[j]), int(forest.positions[j])) for j in keys), key=lambda tp: tp[1]))
    return out


def test_exact_prompt_group_packs_the_prompt_once_with_one_leaf_per_sample():
    prompt = [5, 6, 7, 8]
    forest = build_prefix_forest(*padded([(prompt, [10, 11, 12]), (prompt, [20, 21]), (prompt, [30, 31, 32])]))
    root, *leaves = forest.nodes
    assert (root.parent, root.depth, root.length) == (-1, 0, len(prompt))
    # Each row is cut after its last selected position: the final response token predicts nothing.
    assert [(n.parent, n.depth, n.length) for n in leaves] == [(0, 4, 2), (0, 4, 1), (0, 4, 2)]
    assert forest.stats.tokens_packed == 4 + 2 + 1 + 2
    assert forest.stats.tokens_needed == 3 * 4 + 2 + 1 + 2
    assert forest.stats.shared_tokens == 2 * 4


def test_shared_system_prompt_becomes_the_root_of_different_questions():
    system, q1, q2 = [1, 2, 3], [40, 41], [50]
    forest = build_prefix_forest(*padded([(system + q1, [9, 9]), (system + q1, [8, 8]), (system + q2, [7, 7, 7])]))
    shapes = [(n.parent, n.depth, n.length) for n in forest.nodes]
    assert shapes == [(-1, 0, 3), (0, 3, 2), (1, 5, 1), (1, 5, 1), (0, 3, 3)]


def test_multi_turn_history_is_shared_with_its_continuation():
    turn1, answer1, turn2 = [1, 2, 3], [4, 5], [6, 7]
    history = turn1 + answer1 + turn2
    tensors = padded([(turn1, answer1 + [0]), (history, [8, 9]), (history, [10, 11])])
    forest = build_prefix_forest(*tensors)
    # The first turn's row ends inside the later rows' history: its positions are theirs.
    assert forest.stats.tokens_packed == len(history) + 1 + 1
    assert forest.nodes[0].length == len(turn1) + len(answer1)
    assert packed_contexts(forest) == unpacked_rows(*tensors)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_every_selected_token_sees_exactly_its_own_unpadded_context(padding):
    rows = [([1, 2, 3, 4], [5, 6, 7]), ([1, 2, 3, 4], [5, 8]), ([1, 2, 9], [3, 3, 3, 3]), ([7], [1, 2])]
    tensors = padded(rows, padding)
    assert packed_contexts(build_prefix_forest(*tensors)) == unpacked_rows(*tensors)


def test_left_and_right_padding_build_the_same_forest():
    rows = [([1, 2, 3], [4, 5, 6]), ([1, 2, 3], [7]), ([2, 2], [1, 1, 1, 1])]
    left, right = build_prefix_forest(*padded(rows, "left")), build_prefix_forest(*padded(rows, "right"))
    assert left.nodes == right.nodes
    assert torch.equal(left.token_ids, right.token_ids) and torch.equal(left.select_index, right.select_index)


def test_identical_rows_share_every_token():
    forest = build_prefix_forest(*padded([([1, 2], [3, 4]), ([1, 2], [3, 4])]))
    assert forest.stats.tokens_packed == 3
    first, second = forest.select_index.view(2, -1)
    assert torch.equal(first, second)


def test_rows_with_nothing_selected_are_left_out():
    input_ids, attention_mask, select = padded([([1, 2], [3, 4]), ([5, 6], [7, 8])])
    select[1] = False
    forest = build_prefix_forest(input_ids, attention_mask, select)
    assert forest.stats.tokens_packed == 3 and forest.stats.selected == 2


def test_batch_with_nothing_shared_packs_every_needed_token_once():
    forest = build_prefix_forest(*padded([([1, 2], [3, 4]), ([5, 6, 7], [8])]))
    assert forest.stats.shared_tokens == 0
    assert forest.stats.tokens_packed == 3 + 3


def test_positions_restart_at_zero_in_every_row():
    forest = build_prefix_forest(*padded([([1, 2, 3], [4, 5]), ([9, 9], [1])], "left"))
    assert forest.positions.tolist() == [0, 1, 2, 3, 0, 1]


def test_metrics_report_tokens_before_and_after_sharing():
    metrics = build_prefix_forest(*padded([([1, 2, 3, 4], [5, 6]), ([1, 2, 3, 4], [7, 8])])).stats.metrics()
    assert metrics["zorro_train/tokens_real"] == 12.0
    assert metrics["zorro_train/tokens_packed"] == 4 + 1 + 1
    assert metrics["zorro_train/dedup_ratio"] == 2.0


def test_select_on_padding_is_rejected_by_name():
    input_ids, attention_mask, select = padded([([1, 2], [3]), ([1, 2, 3], [4, 5])])
    select[0, -1] = True
    with pytest.raises(ValueError, match="select marks padding at row 0"):
        build_prefix_forest(input_ids, attention_mask, select)


def test_mismatched_shapes_are_rejected_by_name():
    input_ids, attention_mask, select = padded([([1, 2], [3])])
    with pytest.raises(ValueError, match="attention_mask must have input_ids' shape"):
        build_prefix_forest(input_ids, attention_mask[:, :-1], select)
