"""Work plans for the paged attention kernel: which queries read which KV positions, and how results merge.

The kernel runs a flat list of work items. An item is a tile of queries (one
request's new tokens in prefill; the members of a shared prefix, or a single
request, in decode) and a range of KV positions read through one block table.
A query whose attention is split over several items (a shared prefix plus its
suffix, or a long context split for parallelism) gets one partial result per
item, with its log-sum-exp, and a merge pass combines them; a query served by
a single item is written directly.

Every item starts at a multiple of the cache block size (or of ``KV_ALIGN``,
for larger blocks): shared prefixes are whole blocks and chunks are multiples
of ``KV_ALIGN``. So the kernel finds the blocks of a step's positions without
dividing each position.

Two tile widths exist because a decode request alone fills only ``group``
rows (query heads per KV head) of a matrix tile, while a group of requests
sharing a prefix, or a prefill tile, fills a wide one.

The kernel's programs take items in turn, so a decode plan given its
``lanes`` (programs per KV head) cuts the shared prefixes into pieces of
unequal length that give every lane about the same work
(``_balanced_pieces``), instead of even chunks that leave some lanes a
second item while others idle.
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

KV_ALIGN = 64  # KV positions per kernel step at most; chunks are multiples of it

# ``TileShape`` fields for 128-row wide tiles, two 8-warp programs per SM, a group of up to 18 requests in one
# tile (the default until 2026-12-05; on an H100 2% faster than 64-row tiles at 4 groups of 16, 39% slower at
# one group). The sweep, the register script and the GPU tests keep it as a variant.
ROWS_128 = dict(wide_rows=128, wide_warps=8, chunk_per_row=2, wide_maxnreg=128)


@dataclass(frozen=True)
class TileShape:
    """How the kernel tiles work: ``rows // group`` queries of ``group`` heads share one KV head's tile.

    ``block_n`` KV positions are streamed per step; wide tiles run with
    ``wide_warps`` warps. A multi-query chunk writes ``rows * head_dim``
    partials and reads ``chunk * head_dim * 2`` cache values, so chunks are at
    least ``chunk_per_row * rows`` long: the writes stay a small fraction of
    the reads while enough chunks remain to fill the device.

    ``stages`` is Triton's software pipelining of the narrow tiles' loads;
    ``wide_maxnreg`` caps the wide kernel's registers so that more of its
    programs fit on a multiprocessor (two 8-warp ones at 128, three 4-warp
    ones at 168); ``pdl`` lets the merge launch start
    while the attention kernel drains (programmatic dependent launch);
    ``early_loads`` lets the attention kernel read its plan and positions
    before it waits for the kernel that wrote its queries;
    ``wide_stages`` is Triton's software pipelining of the wide tiles' loads;
    ``int32_offsets`` computes cache offsets in 32 bits where the cache
    allows (else in 64).
    """

    group: int
    # Defaults from ``benchmarks/fca_sweep.py`` and ``fca.py`` (Qwen2-0.5B attention shape): 64-row tiles (up to
    # 9 requests of a group each) give one group twice the programs of 128-row ones; on an H100 a decode step of
    # G=16 with an 8K prompt took 1.17 ms instead of 1.275, while 4 groups of 16 lost 2% of attention time.
    # The plan is not what holds 128 rows back: read with no math, its 4x16 plans take 13.3-14.9 us against 18.6 for
    # 64-row ones, and the kernel at 64 rows runs as fast as its plan reads (H100; docs/benchmarks.md, 16th session).
    wide_rows: int = 64
    narrow_rows: int = 16
    block_n: int = 64
    wide_warps: int = 4
    chunk_per_row: int = 4
    stages: int = 2
    wide_maxnreg: int | None = None
    pdl: bool = True
    # 0.7-0.8 us faster in both fca_sweep cases on an H100 (2026-12-05), when the early loads also took the older
    # keys of the hand-prefetched step loop (since removed); now they are the plan and positions, not re-timed alone.
    early_loads: bool = True
    # Each step's keys and values sit behind a load of its block ids, which takes a stage of Triton's pipeline: at 3
    # or 4 stages it copies a step's keys at the end of the step before, at 5 two steps ahead. On an H100 (27th
    # session, same call) 5 took the wide tiles' launch from 17.1-17.6 to 16.6-16.8 us at 4x16 (from loads one step
    # ahead by hand in registers, the default before and since removed; 4 stages: 20.0, 6 and 7 no better than 5).
    # With the merge's carveout matched (triton_attention.SHARED_CARVEOUT) FCA went from 19.0-19.3 to 18.5-18.7 us
    # (1x16: 9.0-9.2 to 8.7-8.8).
    wide_stages: int = 5
    # On an H100 (13th session, same call): our plain paged kernel 2-3% faster (60.1 -> 58.3 us at 4x16), FCA the
    # same or 0.1-0.3 us faster. A whole wide step: 379 -> 346 instructions (Triton 3.6; test_triton_kernels_compile),
    # the narrow one 255 -> 223.
    int32_offsets: bool = True

    def __post_init__(self):
        if self.group < 1 or self.group > self.narrow_rows:
            raise ValueError(f"query heads per KV head must be in [1, {self.narrow_rows}], got {self.group}")
        if self.stages < 1 or self.wide_stages < 1:
            raise ValueError(f"stages and wide_stages: expected pipeline depths of at least 1, got {self.stages} and "
                             f"{self.wide_stages}")  # fmt: skip

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
    # Decode plans: per query, the longest context the plan serves. Its last suffix chunk ends there,
    # and the kernel stops each item at its queries' positions, so decode steps reuse the plan until
    # a context outgrows it.
    capacity: np.ndarray | None = None

    @property
    def num_partial_rows(self) -> int:
        return len(self.merge_rows)

    @property
    def num_items(self) -> int:
        return len(self.wide_items) + len(self.narrow_items)


@dataclass
class _Tiles:
    """Tiles of queries over KV ranges, as arrays: tile ``t`` is ``queries[offset[t]:offset[t] + count[t]]``."""

    queries: np.ndarray
    offset: np.ndarray
    count: np.ndarray
    table_row: np.ndarray
    start: np.ndarray
    end: np.ndarray

    @classmethod
    def build(cls, groups: list[tuple[Sequence[int], int, int, int]], singles: tuple[np.ndarray, ...]) -> "_Tiles":
        """From multi-query tiles ``(queries, table_row, start, end)`` and arrays of single-query ones."""
        single_q, single_row, single_start, single_end = singles
        counts = np.array([len(g[0]) for g in groups] + [1] * len(single_q), dtype=np.int64)
        return cls(
            queries=np.concatenate([np.fromiter((q for g in groups for q in g[0]), dtype=np.int64), single_q]),
            offset=np.cumsum(counts) - counts,
            count=counts,
            table_row=np.concatenate([np.array([g[1] for g in groups], dtype=np.int64), single_row]),
            start=np.concatenate([np.array([g[2] for g in groups], dtype=np.int64), single_start]),
            end=np.concatenate([np.array([g[3] for g in groups], dtype=np.int64), single_end]),
        )


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _split_members(members: Sequence[int], tiles: TileShape) -> list[Sequence[int]]:
    width = tiles.narrow_queries if len(members) <= tiles.narrow_queries else tiles.wide_queries
    return [members[i : i + width] for i in range(0, len(members), width)]


def _pieces(t: _Tiles, chunk: np.ndarray, room: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Every tile cut into ``chunk``-long pieces: (tile, kv start, kv end, positions read now) per piece.

    ``room``: per tile, where its last piece ends (at or past ``t.end``; the kernel stops at the queries).
    """
    n_chunks = -(-(t.end - t.start) // chunk)
    tile_of = np.repeat(np.arange(len(n_chunks)), n_chunks)
    k = np.arange(len(tile_of)) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    kv0 = t.start[tile_of] + k * chunk[tile_of]
    kv1 = np.minimum(kv0 + chunk[tile_of], (t.end if room is None else room)[tile_of])
    work = np.minimum(kv0 + chunk[tile_of], t.end[tile_of]) - kv0  # what the kernel reads now
    return tile_of, kv0, kv1, work


def _longest_first(pieces: tuple[np.ndarray, ...]) -> np.ndarray:
    """The order that runs the pieces reading most first: it evens out the persistent kernel's programs."""
    return np.argsort(-pieces[3], kind="stable")


def _emit(
    t: _Tiles, pieces: tuple[np.ndarray, ...], order: np.ndarray, num_queries: int, tiles: TileShape
) -> AttentionPlan:
    """The plan of ``pieces`` (``_pieces``), run in ``order``: wide items, then narrow ones (vectorized)."""
    tile_of, kv0, kv1, _ = (a[order] for a in pieces)
    n_pieces = np.bincount(tile_of, minlength=len(t.count))
    # A query served by exactly one item is written directly; otherwise each of its items leaves a partial.
    per_query = np.bincount(t.queries, weights=np.repeat(n_pieces, t.count), minlength=num_queries)
    direct_tile = np.maximum.reduceat(per_query[t.queries], t.offset) == 1 if len(t.offset) else np.zeros(0, dtype=bool)
    direct = direct_tile[tile_of]
    rows = np.where(direct, 0, t.count[tile_of])
    row_base = np.cumsum(rows) - rows

    partial = np.flatnonzero(~direct)
    widths = t.count[tile_of[partial]]
    owner = np.repeat(partial, widths)
    j = np.arange(len(owner)) - np.repeat(np.cumsum(widths) - widths, widths)
    entry_query = t.queries[t.offset[tile_of[owner]] + j]
    merge_order = np.argsort(entry_query, kind="stable")
    merge_offsets = np.zeros(num_queries + 1, dtype=np.int32)
    merge_offsets[1:] = np.cumsum(np.bincount(entry_query, minlength=num_queries))

    items = np.stack(
        [t.offset[tile_of], t.count[tile_of], t.table_row[tile_of], kv0, kv1, np.where(direct, DIRECT, row_base)],
        axis=1,
    ).astype(np.int32)
    wide = items[:, QUERY_COUNT] > tiles.narrow_queries
    return AttentionPlan(
        wide_items=items[wide],
        narrow_items=items[~wide],
        query_index=t.queries.astype(np.int32),
        merge_offsets=merge_offsets,
        merge_rows=(row_base[owner] + j)[merge_order].astype(np.int32),
    )


# A work unit's fixed cost (reading its plan, queries and first keys; storing its partials) as the lane balancing
# (``_balanced_pieces``) counts it, in steps of KV_ALIGN positions. Measured with per-program timestamps on an H100
# (4 groups x 16, 8K prefixes): a wide unit took 3.5 us + 0.93 us per 64-key step, a narrow one as long as a wide
# one of the same steps; the fixed part is about 4 steps. 4 instead of 1 took FCA from 20.2-21.1 to 19.7-19.9 us
# there and changed no other forest timed by more than noise (docs/benchmarks.md, seventeenth session).
ITEM_COST = 4


def _kernel_order(order: np.ndarray, wide: np.ndarray) -> np.ndarray:
    """``order`` as the kernel runs it: the wide items, then the narrow ones, each in ``order``."""
    return np.concatenate([order[wide[order]], order[~wide[order]]])


def _makespan(steps: np.ndarray, lanes: int) -> float:
    """The longest lane's cost when item ``s`` (of ``steps`` steps, in run order) runs on lane ``s % lanes``."""
    return float(np.bincount(np.arange(len(steps)) % lanes, weights=steps + ITEM_COST, minlength=lanes).max())


def _balanced_pieces(
    t: _Tiles, pieces: tuple[np.ndarray, ...], order: np.ndarray, wide_tile: np.ndarray, least: np.ndarray, lanes: int
) -> tuple[float, tuple[np.ndarray, ...]] | None:
    """Wide tiles cut to even out the lanes: each lane's wide piece is as long as the narrow pieces after it allow.

    The kernel's ``P`` programs run its work units (item, KV head) in turn:
    program ``p`` takes units ``p, p + P, ...``, the wide items' first. So with
    ``lanes = P / kv_heads``, item ``i`` (wide ones first) runs on lane
    ``i % lanes``. Even chunks give some lanes two wide items and others one
    (or one and a short narrow one), and the kernel lasts as long as its
    longest lane. Here the narrow pieces keep their chunks, and the wide tiles
    are cut in lane order, one piece per lane, each as long as a common bound
    (the least that covers every tile, by bisection) minus the narrow work
    that lane runs after it. ``order``: the even pieces' run order (the
    narrow ones keep theirs); ``least``: per tile, the shortest piece, in
    steps. Returns the longest lane's cost (``_makespan``) and the pieces in
    run order; None where there is no wide tile or more than there are lanes.
    """
    tile_of, kv0, kv1, work = pieces
    narrow = order[~wide_tile[tile_of[order]]]
    narrow_steps = -(-work[narrow] // KV_ALIGN)
    wide = np.flatnonzero(wide_tile)
    length = -(-(t.end[wide] - t.start[wide]) // KV_ALIGN)
    least = np.minimum(least[wide], length)
    if len(wide) == 0 or len(wide) > lanes:
        return None

    length, least, wide_list = length.tolist(), least.tolist(), wide.tolist()

    def fill(bound: int, narrow_load: list[float]) -> list[tuple[int, int, int]] | None:
        out, i, done = [], 0, 0
        for lane in range(lanes):
            take = int(min(max(bound - ITEM_COST - narrow_load[lane], least[i]), length[i] - done))
            out.append((wide_list[i], done, take))
            done += take
            if done == length[i]:
                i, done = i + 1, 0
                if i == len(wide_list):
                    return out
        return None

    best = None
    count = lanes  # wide pieces, which decides where the narrow ones run
    for _ in range(3):
        narrow_load = np.bincount((count + np.arange(len(narrow))) % lanes, weights=narrow_steps + ITEM_COST,
                                  minlength=lanes).tolist()  # fmt: skip
        lo, hi = 1, int(ITEM_COST + max(narrow_load) + max(length))
        while lo < hi:
            mid = (lo + hi) // 2
            if fill(mid, narrow_load) is None:
                lo = mid + 1
            else:
                hi = mid
        cut = np.array(fill(lo, narrow_load), dtype=np.int64).reshape(-1, 3)
        starts = t.start[cut[:, 0]] + cut[:, 1] * KV_ALIGN
        ends = np.minimum(starts + cut[:, 2] * KV_ALIGN, t.end[cut[:, 0]])
        steps = np.concatenate([cut[:, 2], narrow_steps])
        cost = _makespan(steps, lanes)
        if best is None or cost < best[0]:
            layout = (
                np.concatenate([cut[:, 0], tile_of[narrow]]),
                np.concatenate([starts, kv0[narrow]]),
                np.concatenate([ends, kv1[narrow]]),
                np.concatenate([ends - starts, work[narrow]]),
            )
            best = (cost, layout)
        if len(cut) == count:
            break
        count = len(cut)
    return best


def decode_buffer_sizes(max_seqs: int, target_items: int, tiles: TileShape) -> tuple[int, int]:
    """``plan_decode``'s ``max_items`` and ``max_partial_rows`` for a captured graph's buffers.

    Room for the plans of up to ``max_seqs`` requests split into about
    ``target_items`` items, and for their lane-balanced cut
    (``_balanced_pieces``), which gives each of the kernel's lanes one piece of
    a shared prefix, up to ``tiles.wide_queries`` partial rows each (there are
    at most ``target_items`` lanes while at most four of the kernel's programs
    fit on a multiprocessor; ``plan_decode`` plans even chunks where the cut
    does not fit).
    """
    max_items = 2 * max_seqs + 2 * target_items
    max_partial_rows = 4 * max_seqs + 4 * target_items + target_items * tiles.wide_queries
    return max_items, max_partial_rows


def plan_decode(
    forest: PrefixForest,
    context_lens: Sequence[int],
    tiles: TileShape,
    target_items: int,
    max_items: int | None = None,
    max_partial_rows: int | None = None,
    lanes: int | None = None,
) -> AttentionPlan:
    """One query per request (its block-table row is its index): the forest's prefixes, then each suffix.

    Contexts are split into chunks so that at most ``target_items`` items exist
    (about enough to fill the device); chunks grow until the plan fits the
    capacities of a captured graph's buffers. Each suffix's last chunk is
    planned at its full length, so the plan serves the following decode steps
    too, up to ``capacity``. Given the kernel's ``lanes`` (its programs per KV
    head), the shared prefixes are cut to even out the programs' work instead
    (``_balanced_pieces``) wherever that shortens the longest lane and the cut
    fits the capacities (else the even chunks are planned).
    """
    groups = [
        (members, p.source, p.start, p.end) for p in forest.prefixes for members in _split_members(p.members, tiles)
    ]
    lengths = np.asarray(context_lens, dtype=np.int64)
    starts = np.asarray(forest.suffix_starts, dtype=np.int64)
    own = np.flatnonzero(starts < lengths)
    t = _Tiles.build(groups, (own, own, starts[own], lengths[own]))
    suffix = np.arange(len(t.count)) >= len(groups)
    total = int((t.end - t.start).sum())
    floor = max(KV_ALIGN, _round_up(-(-total // max(target_items, 1)), KV_ALIGN))
    # A multi-query tile writes rows * head_dim partials per chunk: keep its chunks long enough to amortise that.
    group_floor = -(-tiles.chunk_per_row * t.count * tiles.group // KV_ALIGN) * KV_ALIGN
    longest = int((t.end - t.start).max(initial=0))
    wide_tile = t.count > tiles.narrow_queries

    def chunks(floor: int) -> np.ndarray:
        return np.where(t.count == 1, floor, np.maximum(floor, group_floor))

    # Each range rounds up to whole chunks, up to one item more per tile than total / floor: take the
    # smallest chunk whose count is within the target (the persistent kernel runs its units in waves
    # of its programs, and a few units over a wave cost a whole one). The count falls as chunks grow.
    lo, hi = floor // KV_ALIGN, max(floor, _round_up(longest, KV_ALIGN)) // KV_ALIGN
    while lo < hi:
        mid = (lo + hi) // 2
        if (-(-(t.end - t.start) // chunks(mid * KV_ALIGN))).sum() <= target_items:
            hi = mid
        else:
            lo = mid + 1
    floor = lo * KV_ALIGN
    while True:
        chunk = chunks(floor)
        # Each suffix's last chunk runs to its full length: room for the tokens later steps add.
        room = np.where(suffix, t.start + _round_up(t.end - t.start, chunk), t.end)
        pieces = _pieces(t, chunk, room)
        order = _kernel_order(_longest_first(pieces), wide_tile[pieces[0]])
        candidates = [(pieces, order)]
        if lanes:
            balanced = _balanced_pieces(t, pieces, order, wide_tile, group_floor // KV_ALIGN, lanes)
            if balanced is not None and balanced[0] < _makespan(-(-pieces[3][order] // KV_ALIGN), lanes):
                # Already in run order. Its size does not shrink as chunks grow (one piece per lane), so where
                # it exceeds the capacities the even chunks are taken instead.
                candidates.insert(0, (balanced[1], np.arange(len(balanced[1][0]))))
        for pieces, order in candidates:
            plan = _emit(t, pieces, order, len(lengths), tiles)
            fits = (max_items is None or plan.num_items <= max_items) and (
                max_partial_rows is None or plan.num_partial_rows <= max_partial_rows
            )
            if fits:
                plan.capacity = lengths.copy()  # a query with no suffix item needs a new plan at its next token
                plan.capacity[own] = room[suffix]
                return plan
        if floor >= longest:
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
    groups = []
    offset = 0
    for r, (n_new, length) in enumerate(zip(query_lens, context_lens)):
        for members in _split_members(range(offset, offset + n_new), tiles):
            groups.append((members, r, 0, length - (offset + n_new - members[-1] - 1)))
        offset += n_new
    t = _Tiles.build(groups, tuple(np.zeros(0, dtype=np.int64) for _ in range(4)))
    pieces = _pieces(t, np.maximum(t.end, 1))
    return _emit(t, pieces, _longest_first(pieces), offset, tiles)
