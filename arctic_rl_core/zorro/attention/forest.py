"""Prefix forests: which decode requests share which KV-cache blocks.

Requests that hold the same physical blocks at the same positions hold the same
keys and values there. Sorting the block tables puts requests that share a
prefix next to each other, and the longest common prefixes of neighbours then
describe every shared run of blocks (the LCP intervals of the sorted tables,
as in a suffix tree). Each interval is one node of the forest: positions
``[start, end)`` shared by its members. A request's path is the chain of nodes
that contain it (1, 2, 3 or more levels: a system prompt, then a prompt, then a
conversation turn), followed by its own suffix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SharedPrefix:
    """KV positions ``[start, end)`` that every request in ``members`` reads from the same cache blocks."""

    start: int
    end: int
    members: tuple[int, ...]
    # A member whose block table addresses these positions (all members' tables agree there).
    source: int
    depth: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PrefixForest:
    """The shared prefixes of one decode batch, parents before children, and where each request's own KV starts."""

    prefixes: tuple[SharedPrefix, ...]
    suffix_starts: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        return len(self.suffix_starts)

    @property
    def num_levels(self) -> int:
        return max((p.depth for p in self.prefixes), default=0)

    @property
    def has_sharing(self) -> bool:
        return bool(self.prefixes)

    @classmethod
    def unshared(cls, num_requests: int) -> "PrefixForest":
        return cls(prefixes=(), suffix_starts=(0,) * num_requests)


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix, by binary search over C-level slice comparisons."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def build_forest(
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    block_size: int,
    min_shared_blocks: int = 1,
) -> PrefixForest:
    """The prefix forest of a decode batch, from its block tables.

    Only blocks that are full for every member count as shared, so a node never
    covers a position some member has not written. Nodes shorter than
    ``min_shared_blocks`` are folded into their members' paths below them (their
    positions are then read per request, which is always correct).
    """
    n = len(block_tables)
    if len(context_lens) != n:
        raise ValueError(f"context_lens has {len(context_lens)} entries, block_tables has {n}")
    full = [list(table[: length // block_size]) for table, length in zip(block_tables, context_lens)]
    order = sorted(range(n), key=full.__getitem__)
    # lcp[k]: blocks shared by the requests at sorted positions k-1 and k; 0 at both ends closes every interval.
    lcp = [0] + [_common_prefix_length(full[order[k - 1]], full[order[k]]) for k in range(1, n)] + [0]

    # (blocks_end, blocks_start, left, right) of every LCP interval; see the module docstring.
    intervals: list[tuple[int, int, int, int]] = []
    stack: list[list[int]] = [[0, 0]]  # [lcp, left]
    for k in range(1, n + 1):
        left = k - 1
        while lcp[k] < stack[-1][0]:
            depth_end, left = stack.pop()
            parent_end = max(stack[-1][0], lcp[k])
            intervals.append((depth_end, parent_end, left, k - 1))
        if lcp[k] > stack[-1][0]:
            stack.append([lcp[k], left])

    # Fold short nodes into their children: a child then starts where its nearest kept ancestor ends.
    intervals.sort(key=lambda iv: (iv[2], -iv[3], iv[1]))  # outer intervals first
    kept: list[tuple[int, int, int, int, int]] = []  # (end, start, left, right, depth)
    open_chain: list[tuple[int, int, int, int]] = []  # kept ancestors (end, left, right, depth)
    suffix_blocks = [0] * n
    for end, _, left, right in intervals:
        while open_chain and not (open_chain[-1][1] <= left and right <= open_chain[-1][2]):
            open_chain.pop()
        start = open_chain[-1][0] if open_chain else 0
        if end - start < min_shared_blocks:
            continue
        depth = (open_chain[-1][3] if open_chain else 0) + 1
        kept.append((end, start, left, right, depth))
        open_chain.append((end, left, right, depth))
        for pos in range(left, right + 1):
            suffix_blocks[order[pos]] = max(suffix_blocks[order[pos]], end)

    prefixes = tuple(
        SharedPrefix(
            start=start * block_size,
            end=end * block_size,
            members=tuple(sorted(order[left : right + 1])),
            source=order[left],
            depth=depth,
        )
        for end, start, left, right, depth in kept
    )
    return PrefixForest(prefixes=prefixes, suffix_starts=tuple(b * block_size for b in suffix_blocks))
