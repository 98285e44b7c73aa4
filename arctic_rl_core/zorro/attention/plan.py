"""Work plans for the paged attention kernel: which queries read which KV positions, and how results merge.

The kernel runs a flat list of work items. An item is a tile of queries (one
request's new tokens in prefill; the members of a shared prefix, or a single
request, in decode) and a range of KV positions read through one block table.
A query whose attention is split over several items (a shared prefix plus its
suffix, or a long context split for parallelism) gets one partial result per
item, with its log-sum-exp, and a merge pass combines them; a query served by
a single item is written directly.

Two tile widths exist because a decode request alone fills only ``group``
rows (query heads per KV head) of a matrix tile, while a group of requests
sharing a prefix, or a prefill tile, fills a wide one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from arctic_rl_core.zorro.attention.forest import PrefixForest

# Columns of an item row.
QUERY_OFFSET, QUERY_COUNT, TABLE_ROW, KV_START, KV_END, PARTIAL_ROW = range(6)
ITEM_FIELDS = 6
DIRECT = -1  # PARTIAL_ROW of an item that writes its queries' final output

KV_ALIGN = 64  # KV positions per kernel step; chunks are multiples of it
# A shared-prefix chunk writes rows * head_dim float32 partials and reads
# chunk * head_dim * 2 (K and V) cache values; this keeps the writes a small
# fraction of the reads.
PARTIAL_WRITE_RATIO = 4


@dataclass(frozen=True)
class TileShape:
    """Query rows per tile: ``rows // group`` queries of ``group`` heads each share one KV head's tile."""

    group: int
    wide_rows: int = 128
    narrow_rows: int = 16

    def __post_init__(self):
        if self.group < 1 or self.group > self.narrow_rows:
            raise ValueError(f"query heads per KV head must be in [1, {self.narrow_rows}], got {self.group}")

    @property
    def wide_queries(self) -> int:
        return self.wide_rows // self.group

    @property
    def narrow_queries(self) -> int:
        return self.narrow_rows // self.group


@dataclass
class AttentionPlan:
    """Items and merge lists, as int32 arrays ready to copy to the device."""

    wide_items: np.ndarray
    narrow_items: np.ndarray
    query_index: np.ndarray
    merge_offsets: np.ndarray
    merge_rows: np.ndarray

    @property
    def num_partial_rows(self) -> int:
        return len(self.merge_rows)

    @property
    def num_items(self) -> int:
        return len(self.wide_items) + len(self.narrow_items)


@dataclass(frozen=True)
class _Segment:
    queries: tuple[int, ...]
    table_row: int
    start: int
    end: int


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _emit(segments: list[tuple[_Segment, int]], num_queries: int, tiles: TileShape) -> AttentionPlan:
    """Items of ``(segment, chunk)`` pairs: tiles of queries times chunks of positions, longest first."""
    pieces = []
    for seg, chunk in segments:
        width = tiles.narrow_queries if len(seg.queries) <= tiles.narrow_queries else tiles.wide_queries
        for q0 in range(0, len(seg.queries), width):
            queries = seg.queries[q0 : q0 + width]
            for kv0 in range(seg.start, seg.end, chunk):
                pieces.append((queries, seg.table_row, kv0, min(kv0 + chunk, seg.end)))
    pieces.sort(key=lambda p: p[2] - p[3])  # longest first balances the persistent kernel's programs

    items_per_query = [0] * num_queries
    for queries, *_ in pieces:
        for q in queries:
            items_per_query[q] += 1

    wide, narrow, query_index = [], [], []
    partials: list[list[int]] = [[] for _ in range(num_queries)]
    num_rows = 0
    for queries, table_row, kv0, kv1 in pieces:
        direct = all(items_per_query[q] == 1 for q in queries)
        row = DIRECT if direct else num_rows
        if not direct:
            for i, q in enumerate(queries):
                partials[q].append(num_rows + i)
            num_rows += len(queries)
        item = (len(query_index), len(queries), table_row, kv0, kv1, row)
        (narrow if len(queries) <= tiles.narrow_queries else wide).append(item)
        query_index.extend(queries)

    offsets = np.zeros(num_queries + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(p) for p in partials])
    rows = np.fromiter((r for p in partials for r in p), dtype=np.int32, count=int(offsets[-1]))
    return AttentionPlan(
        wide_items=np.array(wide, dtype=np.int32).reshape(-1, ITEM_FIELDS),
        narrow_items=np.array(narrow, dtype=np.int32).reshape(-1, ITEM_FIELDS),
        query_index=np.array(query_index, dtype=np.int32),
        merge_offsets=offsets,
        merge_rows=rows,
    )


def plan_decode(
    forest: PrefixForest,
    context_lens: Sequence[int],
    tiles: TileShape,
    target_items: int,
    max_items: int | None = None,
    max_partial_rows: int | None = None,
) -> AttentionPlan:
    """One query per request (its block-table row is its index): the forest's prefixes, then each suffix.

    Contexts are split into chunks so that about ``target_items`` items exist
    (enough to fill the device); chunks grow until the plan fits the
    capacities of a captured graph's buffers.
    """
    segments = [_Segment(p.members, p.source, p.start, p.end) for p in forest.prefixes]
    segments += [
        _Segment((r,), r, start, length)
        for r, (start, length) in enumerate(zip(forest.suffix_starts, context_lens))
        if start < length
    ]
    total = sum(s.end - s.start for s in segments)
    floor = max(KV_ALIGN, _round_up(-(-total // max(target_items, 1)), KV_ALIGN))
    while True:
        chunked = []
        for seg in segments:
            rows = min(len(seg.queries), tiles.wide_queries) * tiles.group
            chunk = floor if len(seg.queries) == 1 else max(floor, _round_up(PARTIAL_WRITE_RATIO * rows, KV_ALIGN))
            chunked.append((seg, chunk))
        plan = _emit(chunked, len(context_lens), tiles)
        fits = (max_items is None or plan.num_items <= max_items) and (
            max_partial_rows is None or plan.num_partial_rows <= max_partial_rows
        )
        if fits:
            return plan
        if floor >= max((s.end - s.start for s in segments), default=0):
            raise ValueError(
                f"decode plan needs {plan.num_items} items and {plan.num_partial_rows} partial rows even unsplit; "
                f"capacity is {max_items} and {max_partial_rows}"
            )
        floor *= 2


def plan_prefill(query_lens: Sequence[int], context_lens: Sequence[int], tiles: TileShape) -> AttentionPlan:
    """Causal attention of each request's new tokens (laid out back to back) over its whole context.

    Each tile reads positions up to its last query's position; the kernel
    masks the later ones per query. Nothing is split, so every item writes
    its output directly.
    """
    segments = []
    offset = 0
    for r, (n_new, length) in enumerate(zip(query_lens, context_lens)):
        width = tiles.narrow_queries if n_new <= tiles.narrow_queries else tiles.wide_queries
        for q0 in range(0, n_new, width):
            q1 = min(q0 + width, n_new)
            queries = tuple(range(offset + q0, offset + q1))
            end = length - n_new + q1
            segments.append((_Segment(queries, r, 0, end), max(end, 1)))
        offset += n_new
    return _emit(segments, offset, tiles)
