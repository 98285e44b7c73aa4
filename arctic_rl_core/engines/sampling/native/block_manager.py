"""The paged KV cache's bookkeeping: block tables, reference counts and the prefix cache.

The block manager alone hands out blocks and writes block tables. A full block
is registered under a hash chained over every token up to its end, so two
sequences with the same first ``k * block_size`` tokens map those positions to
the same blocks: the second computes nothing there, and decode batches that
share blocks become Forest Cascade Attention groups. Freed blocks keep their
registration until they are handed out again (least recently freed first),
so a later request with the same prefix still hits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from arctic_rl_core.engines.sampling.native.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, served from cached blocks

    def to_dict(self) -> dict:
        return {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens}


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"the KV cache has room for {num_blocks} blocks; at least 1 is needed")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Blocks in use at the last reset: their KV may predate it (older weights), so none is registered again.
        self.stale: set[int] = set()
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def _cacheable_blocks(self, seq: Sequence) -> int:
        """Leading blocks a sequence may take from the cache: full ones before its last token.

        The last token must be computed (its logits give the next token), and
        so must its whole block, which the sequence will keep writing into.
        """
        return (seq.num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0

    def _lookup(self, parent: int | None, tokens: tuple[int, ...]) -> tuple[int, int | None]:
        h = hash((parent, tokens))
        block = self.hash_to_block.get(h)
        if block is not None and self.block_tokens[block] != tokens:
            block = None  # a hash collision: treat as a miss
        return h, block

    def num_cached_blocks(self, seq: Sequence) -> int:
        """How many leading blocks ``allocate`` would take from the cache now."""
        parent = None
        for i in range(self._cacheable_blocks(seq)):
            parent, block = self._lookup(parent, tuple(seq.block_tokens(i)))
            if block is None:
                return i
        return self._cacheable_blocks(seq)

    def can_allocate(self, seq: Sequence, cached_blocks: int) -> bool:
        parent, revived = None, 0
        for i in range(cached_blocks):
            parent, block = self._lookup(parent, tuple(seq.block_tokens(i)))
            revived += self.ref_counts[block] == 0  # a cached block sitting in the free pool leaves it
        return seq.num_blocks - cached_blocks + revived <= len(self.free)

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hashes[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.hashes[block] = None
        self.block_tokens[block] = None
        self.ref_counts[block] = 1
        self.stale.discard(block)
        return block

    def _register(self, block: int, h: int, tokens: tuple[int, ...]) -> None:
        self.hashes[block] = h
        self.block_tokens[block] = tokens
        self.hash_to_block.setdefault(h, block)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence its blocks, sharing cached ones; sets ``num_cached_tokens``."""
        cacheable = self._cacheable_blocks(seq)
        parent, hits = None, 0
        for i in range(seq.num_blocks):
            tokens = tuple(seq.block_tokens(i))
            # The chain of hashes runs over full blocks from the start; a partial block ends it.
            chained = self.enable_prefix_caching and len(tokens) == self.block_size and (i == 0 or parent is not None)
            h = hash((parent, tokens)) if chained else None
            block = None
            if h is not None and i < cacheable and hits == i:
                candidate = self.hash_to_block.get(h)
                if candidate is not None and self.block_tokens[candidate] == tokens:
                    block = candidate
                    if self.ref_counts[block] == 0:
                        del self.free[block]
                    self.ref_counts[block] += 1
                    hits += 1
            if block is None:
                block = self._take_free()
                if h is not None:
                    self._register(block, h, tokens)
            seq.block_table.append(block)
            parent = h
        seq.num_cached_tokens = hits * self.block_size
        seq.allocations += 1
        self.stats.queried_tokens += seq.num_tokens
        self.stats.hit_tokens += seq.num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks first, so a prefix outlives its continuations in the free pool.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        return len(seq.block_table) >= seq.num_blocks or len(self.free) > 0

    def may_append(self, seq: Sequence) -> None:
        """Before a decode step: a block for the newest token, and the registration of a block it completes.

        A block completed by a token still being sampled (asynchronous
        scheduling) is registered once the token is known: ``register_last_block``.
        """
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free())
        if not seq.has_pending_token:
            self.register_last_block(seq)

    def register_last_block(self, seq: Sequence) -> None:
        """Make the sequence's last block findable by its hash if its newest token completed it."""
        if self.enable_prefix_caching and seq.num_tokens % self.block_size == 0:
            i = seq.num_tokens // self.block_size - 1
            parent = self.hashes[seq.block_table[i - 1]] if i > 0 else None
            if (i == 0 or parent is not None) and seq.block_table[i] not in self.stale:
                tokens = tuple(seq.block_tokens(i))
                self._register(seq.block_table[i], hash((parent, tokens)), tokens)

    def reset_prefix_cache(self) -> None:
        """Forget every registration: blocks in use keep their contents, no future request can hit them."""
        self.stale = {block for block, refs in enumerate(self.ref_counts) if refs}
        self.hash_to_block.clear()
        self.hashes = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
