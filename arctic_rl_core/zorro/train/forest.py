"""The prefix forest of a batch: every distinct token prefix once, laid out for one packed forward.

A decoder's hidden state at position t depends only on the tokens at 0..t of
its own row, so two rows that agree on 0..t share that state exactly. The rows
of a batch, with padding removed, therefore form a forest of prefixes (a radix
tree per distinct first token): GRPO samples of one prompt branch off their
prompt, questions branch off a shared system prompt, later turns branch off
earlier ones. Computing the batch means computing each node of that forest once.

Layout. Nodes are packed in depth-first preorder, which is the lexicographic
order of the rows. Then every node's descendants follow it contiguously, and
the attention pattern of the whole forest is one comparison per pair: a packed
token q sees a packed token k exactly when ``k <= q < subtree_end[k]``, where
``subtree_end[k]`` is one past the last descendant of k's node. Each token's
position is its depth, i.e. its position in its own unpadded row.

Rows are cut after their last selected position: later tokens cannot change
any hidden state a loss reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host-built layout tensors on ``device`` without waiting for the GPU.

    A plain ``.to(device)`` from pageable memory synchronizes the stream; in the
    middle of a forward that drains the queue the host has built up, and a small
    packed batch then runs at the host's pace. ``non_blocking`` stages the bytes
    and returns (the tensors here are never written afterwards).
    """
    return tuple(t.to(device, non_blocking=True) for t in tensors)


@dataclass(frozen=True)
class ForestNode:
    """A run of tokens shared by the same set of rows."""

    parent: int  # index of the parent node, -1 for a root
    depth: int  # position of the node's first token in each of its rows
    length: int
    offset: int  # packed index of the node's first token
    subtree_end: int  # packed index one past the node's last descendant


@dataclass(frozen=True)
class ForestStats:
    """Token counts before and after sharing prefixes, for logs and metrics."""

    rows: int
    tokens_padded: int  # B * T: what a padded forward computes
    tokens_real: int  # non-padding tokens in the batch
    tokens_needed: int  # non-padding tokens up to each row's last selected position
    tokens_packed: int  # distinct prefix tokens: what the packed forward computes
    nodes: int
    selected: int  # hidden-state rows returned

    @property
    def shared_tokens(self) -> int:
        """Tokens computed once for several rows instead of once per row."""
        return self.tokens_needed - self.tokens_packed

    def metrics(self, prefix: str = "zorro_train/") -> dict[str, float]:
        return {
            f"{prefix}tokens_padded": float(self.tokens_padded),
            f"{prefix}tokens_real": float(self.tokens_real),
            f"{prefix}tokens_packed": float(self.tokens_packed),
            f"{prefix}nodes": float(self.nodes),
            f"{prefix}dedup_ratio": self.tokens_real / max(self.tokens_packed, 1),
        }


@dataclass(frozen=True)
class PrefixForest:
    """A batch as a forest of shared prefixes, packed into one sequence of ``stats.tokens_packed`` tokens.

    All tensors are int64 on the CPU, indexed by packed position unless named otherwise.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor  # RoPE position: the token's depth in its rows
    subtree_end: torch.Tensor  # token q sees token k iff k <= q < subtree_end[k]
    select_index: torch.Tensor  # [N]: packed index of each selected (row, position), row-major
    nodes: tuple[ForestNode, ...]
    stats: ForestStats


class _OpenNode:
    """A node while the forest is being built: its depth range can still be split."""

    __slots__ = ("parent", "depth", "length", "offset", "subtree_end")

    def __init__(self, parent: _OpenNode | None, depth: int, length: int, offset: int):
        self.parent = parent
        self.depth = depth
        self.length = length
        self.offset = offset
        self.subtree_end = -1

    @property
    def depth_end(self) -> int:
        return self.depth + self.length


def _common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _validate(input_ids: torch.Tensor, attention_mask: torch.Tensor, select: torch.Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("select", select)):
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(t.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if select.dtype != torch.bool:
        raise ValueError(f"select must be a bool mask, got dtype {select.dtype}")


def _validate_values(ids: np.ndarray, mask: np.ndarray, chosen: np.ndarray) -> None:
    if ids.size and ids.min() < 0:
        raise ValueError(f"input_ids must be non-negative token ids, got min {ids.min()}")
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must hold only 0 and 1")
    outside = chosen & (mask == 0)
    if outside.any():
        b, t = np.argwhere(outside)[0].tolist()
        raise ValueError(f"select marks padding at row {b}, position {t}; it must be a subset of attention_mask")


def _host_arrays(input_ids, attention_mask, select) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch on the host as int64 ids, mask and bool selection: one transfer (one wait) from a device."""
    if input_ids.device.type == "cpu":
        return input_ids.to(torch.int64).numpy(), attention_mask.numpy(), select.numpy()
    stacked = torch.stack([input_ids.to(torch.int64), attention_mask.to(torch.int64), select.to(torch.int64)])
    ids, mask, chosen = stacked.cpu().numpy()
    return ids, mask, chosen.astype(bool)


def build_prefix_forest(input_ids: torch.Tensor, attention_mask: torch.Tensor, select: torch.Tensor) -> PrefixForest:
    """Build the prefix forest of a [B, T] batch whose hidden states are wanted where ``select`` is True.

    ``attention_mask`` marks real tokens (left, right or any padding); ``select``
    must lie inside it. Runs on the CPU in O(B log B + B * T).
    """
    _validate(input_ids, attention_mask, select)
    ids, mask, chosen = _host_arrays(input_ids, attention_mask, select)
    _validate_values(ids, mask, chosen)
    real = mask.astype(bool)

    # Each row as its real tokens up to its last selected one, plus its selected depths.
    rows: list[np.ndarray] = []
    picked: list[np.ndarray] = []
    for b in range(ids.shape[0]):
        depths = np.flatnonzero(chosen[b][real[b]])
        cut = int(depths[-1]) + 1 if depths.size else 0
        rows.append(ids[b][real[b]][:cut])
        picked.append(depths)

    order = sorted((b for b in range(len(rows)) if len(rows[b])), key=lambda b: rows[b].astype(">i8").tobytes())

    nodes: list[_OpenNode] = []
    path: list[_OpenNode] = []  # root-to-leaf nodes of the row placed last
    packed_of_row: dict[int, np.ndarray] = {}  # depth -> packed index, per row
    segments: list[tuple[int, int, int]] = []  # (row, first new depth, end depth), in packed order
    cursor = 0
    previous = None
    for b in order:
        row = rows[b]
        shared = _common_prefix_length(rows[previous], row) if previous is not None else 0
        # Nodes of the previous row below the branch point are complete.
        while path and path[-1].depth >= shared:
            path.pop().subtree_end = cursor
        # A node that straddles the branch point splits: its upper part becomes a new parent.
        if path and path[-1].depth_end > shared:
            lower = path.pop()
            upper = _OpenNode(lower.parent, lower.depth, shared - lower.depth, lower.offset)
            lower.parent, lower.depth = upper, shared
            lower.length -= upper.length
            lower.offset += upper.length
            lower.subtree_end = cursor
            nodes.append(upper)
            path.append(upper)
        if len(row) > shared:
            leaf = _OpenNode(path[-1] if path else None, shared, len(row) - shared, cursor)
            nodes.append(leaf)
            path.append(leaf)
            segments.append((b, shared, len(row)))
        new = np.arange(cursor, cursor + len(row) - shared)
        packed_of_row[b] = new if previous is None else np.concatenate([packed_of_row[previous][:shared], new])
        cursor += len(row) - shared
        previous = b
    for node in path:
        node.subtree_end = cursor

    nodes.sort(key=lambda n: n.offset)
    index_of = {id(n): i for i, n in enumerate(nodes)}
    frozen = tuple(
        ForestNode(
            parent=index_of[id(n.parent)] if n.parent is not None else -1,
            depth=n.depth,
            length=n.length,
            offset=n.offset,
            subtree_end=n.subtree_end,
        )
        for n in nodes
    )

    empty = np.zeros(0, dtype=np.int64)
    token_ids = np.concatenate([rows[b][lo:hi] for b, lo, hi in segments] or [empty])
    positions = np.concatenate([np.arange(lo, hi) for _, lo, hi in segments] or [empty])
    subtree_end = np.concatenate([np.full(n.length, n.subtree_end) for n in frozen] or [empty])
    select_index = np.concatenate([packed_of_row[b][picked[b]] for b in range(len(rows)) if picked[b].size] or [empty])
    stats = ForestStats(
        rows=ids.shape[0],
        tokens_padded=ids.size,
        tokens_real=int(real.sum()),
        tokens_needed=sum(len(r) for r in rows),
        tokens_packed=cursor,
        nodes=len(frozen),
        selected=len(select_index),
    )
    return PrefixForest(
        token_ids=torch.from_numpy(token_ids.astype(np.int64)),
        positions=torch.from_numpy(positions.astype(np.int64)),
        subtree_end=torch.from_numpy(subtree_end.astype(np.int64)),
        select_index=torch.from_numpy(select_index.astype(np.int64)),
        nodes=frozen,
        stats=stats,
    )
