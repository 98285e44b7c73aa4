"""Micro-batching: the token budget and the minimum count hold together; forward-only calls have bounds of their own."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from arctic_rl_core.config import MicroBatchSpec, TrainingConfig
from arctic_rl_core.engines.batching import RowBatch, micro_batches
from arctic_rl_core.engines.training.worker import DeepSpeedWorker


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


def test_the_row_bound_holds_with_every_budget_and_count():
    for lengths in itertools.product([1, 3, 7], repeat=5):
        batch = _right_padded(list(lengths))
        for max_tokens, min_count, max_rows in itertools.product([None, 9, 40], [1, 3], [1, 2, 4]):
            parts = micro_batches(batch, max_tokens, min_count, max_rows)
            assert len(parts) >= max(min_count, -(-5 // max_rows))
            assert all(p.rows <= max_rows for p in parts), (lengths, max_tokens, min_count, max_rows)
            assert all(max_tokens is None or p.rows == 1 or p.input_ids.numel() <= max_tokens for p in parts)
            assert torch.equal(torch.cat([p.input_ids.sum(-1) for p in parts]), batch.input_ids.sum(-1))


def test_an_empty_batch_has_no_micro_batches():
    empty = RowBatch(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4))
    assert micro_batches(empty, 16, 4, 2) == [] and micro_batches(empty, None) == []


def test_forward_only_calls_take_the_training_row_bound_unless_given_their_own():
    assert MicroBatchSpec().forward_max_rows is None
    assert MicroBatchSpec(max_rows_per_mb=3).forward_max_rows == 3
    assert MicroBatchSpec(max_rows_per_mb=3, max_rows_per_forward_mb=8).forward_max_rows == 8


def test_forward_only_calls_take_the_training_token_budget_unless_given_their_own():
    assert MicroBatchSpec().forward_max_tokens is None
    assert MicroBatchSpec(max_tokens_per_mb=64).forward_max_tokens == 64
    assert MicroBatchSpec(max_tokens_per_mb=64, max_tokens_per_forward_mb=256).forward_max_tokens == 256
    assert MicroBatchSpec(max_tokens_per_forward_mb=256).max_tokens_per_mb is None  # training stays unbounded
    with pytest.raises(ValidationError, match="max_tokens_per_forward_mb"):
        MicroBatchSpec(max_tokens_per_forward_mb=0)


def _forward_pass_shapes(mb_spec: MicroBatchSpec, batch: RowBatch) -> list[list[int]]:
    """The shapes of the passes a single-rank worker without ZeRO-3 runs for a forward-only call."""
    rank = SimpleNamespace(spec=SimpleNamespace(training=TrainingConfig(mb_spec=mb_spec)), _zero_stage=0, device="cpu")
    return [list(part.input_ids.shape) for _, part, _ in DeepSpeedWorker._forward_passes(rank, batch)]


def test_forward_passes_fill_the_forward_token_budget_not_the_training_one():
    batch = _right_padded([6] * 7)
    assert _forward_pass_shapes(MicroBatchSpec(max_tokens_per_mb=12), batch) == [[2, 6]] * 3 + [[1, 6]]
    forward_budget = MicroBatchSpec(max_tokens_per_mb=12, max_tokens_per_forward_mb=30)
    assert _forward_pass_shapes(forward_budget, batch) == [[5, 6], [2, 6]]
    rows_too = MicroBatchSpec(max_tokens_per_mb=12, max_tokens_per_forward_mb=30, max_rows_per_forward_mb=4)
    assert _forward_pass_shapes(rows_too, batch) == [[3, 6], [2, 6], [2, 6]]
