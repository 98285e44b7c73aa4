"""Micro-batching: the token budget and the minimum count hold together."""

import itertools

import torch

from arctic_rl_core.engines.batching import RowBatch, micro_batches


def _right_padded(lengths: list[int]) -> RowBatch:
    width = max(lengths)
    attention = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        attention[row, :length] = 1
    ids = torch.arange(len(lengths) * width).view(len(lengths), width) * attention
    return RowBatch(ids, attention)


def test_minimum_count_never_breaks_the_token_budget():
    lengths = [1, 4, 5, 2, 5, 9, 10, 3]
    parts = micro_batches(_right_padded(lengths), max_tokens=23, min_count=4)
    assert len(parts) >= 4
    assert all(part.input_ids.numel() <= 23 for part in parts), [list(p.input_ids.shape) for p in parts]
    assert torch.equal(torch.cat([p.attention_mask.sum(-1) for p in parts]), torch.tensor(lengths))


def test_every_budget_and_count_keeps_rows_in_order_and_within_budget():
    for lengths in itertools.product([1, 3, 7], repeat=5):
        batch = _right_padded(list(lengths))
        for max_tokens, min_count in itertools.product([7, 9, 15, 40], [1, 2, 3, 5, 8]):
            parts = micro_batches(batch, max_tokens, min_count)
            assert len(parts) >= min(min_count, 5)
            assert all(p.rows == 1 or p.input_ids.numel() <= max_tokens for p in parts), (lengths, max_tokens)
            assert torch.equal(torch.cat([p.input_ids.sum(-1) for p in parts]), batch.input_ids.sum(-1))
