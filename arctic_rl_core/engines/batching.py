"""Splitting a batch across data-parallel ranks and into micro-batches.

Both splits keep rows whole and in order, so sequences of one GRPO group stay
together (ZoRRo packs groups inside a micro-batch), and results are stitched
back by concatenation. Losses are normalized by the whole call's token and
sequence counts, so no split changes the loss or its gradients.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass
class RowBatch:
    """Rows of a model batch plus per-row tensors that travel with them."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor | None = None  # [B, T] float, shifted
    context: dict[str, torch.Tensor] = field(default_factory=dict)  # [B] or [B, T]

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def select(self, start: int, stop: int) -> "RowBatch":
        return RowBatch(
            self.input_ids[start:stop],
            self.attention_mask[start:stop],
            None if self.loss_mask is None else self.loss_mask[start:stop],
            {k: v[start:stop] for k, v in self.context.items()},
        )

    def used_columns(self) -> slice:
        """The columns from the first to the last that is not padding in every row (all of them if none is)."""
        used = self.attention_mask.bool().any(0).nonzero()
        if used.numel() == 0:
            return slice(0, self.input_ids.shape[1])
        return slice(int(used[0]), int(used[-1]) + 1)

    def trimmed(self) -> "RowBatch":
        """Drop columns that are padding in every row (positions come from the mask, so this is exact)."""
        columns = self.used_columns()
        if columns.start == 0 and columns.stop == self.input_ids.shape[1]:
            return self

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[:, columns] if t.dim() > 1 else t

        return RowBatch(
            cut(self.input_ids),
            cut(self.attention_mask),
            None if self.loss_mask is None else cut(self.loss_mask),
            {k: cut(v) for k, v in self.context.items()},
        )

    def to(self, device: torch.device | str) -> "RowBatch":
        return RowBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            None if self.loss_mask is None else self.loss_mask.to(device),
            {k: v.to(device) for k, v in self.context.items()},
        )


def contiguous_split(weights: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut a sequence of weights into ``parts`` contiguous (start, stop) ranges of near-equal total weight.

    Every range is non-empty when there are at least ``parts`` rows; otherwise
    the trailing ranges are empty.
    """
    n, total = len(weights), sum(weights)
    prefix = list(accumulate(weights))
    cuts = [0]
    for k in range(1, parts):
        if n < parts:
            cut = min(k, n)
        else:
            # The fewest rows that reach k/parts of the weight, leaving one row for each later part.
            cut = bisect_left(prefix, total * k / parts) + 1
            cut = min(max(cut, cuts[-1] + 1), n - (parts - k))
        cuts.append(cut)
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:]))


def micro_batches(
    batch: RowBatch, max_tokens: int | None, min_count: int = 1, max_rows: int | None = None
) -> list[RowBatch]:
    """Greedy consecutive packing: each micro-batch's padded size (rows x longest row) stays under ``max_tokens``.

    No micro-batch holds more than ``max_rows`` rows. At least ``min_count`` micro-batches (as many as
    there are rows, at most) come out: the heaviest ranges are halved until there are enough, and a
    part of a range never exceeds the range's budget.
    """
    return [batch.select(a, b).trimmed() for a, b in micro_batch_rows(batch, max_tokens, min_count, max_rows)]


def micro_batch_rows(
    batch: RowBatch, max_tokens: int | None, min_count: int = 1, max_rows: int | None = None
) -> list[tuple[int, int]]:
    """The (start, stop) row ranges of ``micro_batches``, none of them empty."""
    lengths = batch.attention_mask.sum(-1).tolist()
    count = max(1, min(min_count, batch.rows))
    if max_tokens is None:
        ranges = contiguous_split(lengths, count)
    else:
        ranges, start, longest = [], 0, 0
        for row, length in enumerate(lengths):
            longest_with_row = max(longest, length)
            if row > start and longest_with_row * (row - start + 1) > max_tokens:
                ranges.append((start, row))
                start, longest_with_row = row, length
            longest = longest_with_row
        ranges.append((start, batch.rows))
    if max_rows is not None:
        # A range over the row bound becomes the fewest near-equal ranges within it.
        parts = [(a, b, -(-(b - a) // max_rows) or 1) for a, b in ranges]
        ranges = [(a + lo, a + hi) for a, b, n in parts for lo, hi in contiguous_split([1] * (b - a), n)]
    while len(ranges) < count:
        index = max((i for i, (a, b) in enumerate(ranges) if b - a > 1), key=lambda i: sum(lengths[slice(*ranges[i])]))
        a, b = ranges[index]
        ranges[index : index + 1] = [(a + lo, a + hi) for lo, hi in contiguous_split(lengths[a:b], 2)]
    return [(a, b) for a, b in ranges if b > a]
