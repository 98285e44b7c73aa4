"""Continuous batching: which sequences run in the next step, and what finishes after it.

A step is either a prefill (waiting sequences admitted while blocks and the
token budget last) or a decode (every running sequence, one token each,
preempting the newest ones when blocks run out). For a decode batch the
scheduler asks the prefix forest which sequences share KV blocks; that forest
is what Forest Cascade Attention groups by.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from arctic_rl_core.engines.sampling.native.block_manager import BlockManager
from arctic_rl_core.engines.sampling.native.config import EngineConfig
from arctic_rl_core.engines.sampling.native.sequence import Sequence, SequenceStatus
from arctic_rl_core.zorro.attention.forest import PrefixForest, build_forest


@dataclass
class Batch:
    seqs: list[Sequence]
    is_prefill: bool
    forest: PrefixForest | None = None  # decode only; None when FCA is off


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        # The forest changes only when sequences are admitted or preempted (blocks appended in decode are
        # private), so it is cached for the batch and dropped on those events.
        self._forest_key: tuple[int, ...] = ()
        self._forest: PrefixForest | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = self._schedule_prefill()
        return batch if batch.seqs else self._schedule_decode()

    def _schedule_prefill(self) -> Batch:
        seqs: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) + len(seqs) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.num_cached_blocks(seq)
            new_tokens = seq.num_tokens - cached * self.block_manager.block_size
            if new_tokens > budget or not self.block_manager.can_allocate(seq, cached):
                break
            self.block_manager.allocate(seq)
            budget -= seq.num_tokens - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            seqs.append(self.waiting.popleft())
        if seqs:
            self.running.extend(seqs)
            self._forest = None
        elif self.waiting and not self.running:
            seq = self.waiting[0]
            raise RuntimeError(
                f"a sequence of {seq.num_tokens} tokens needs {seq.num_blocks} KV blocks; the cache has "
                f"{self.block_manager.num_blocks} (raise gpu_memory_utilization or lower max_model_len)"
            )
        return Batch(seqs, is_prefill=True)

    def _schedule_decode(self) -> Batch:
        seqs: list[Sequence] = []
        while self.running and len(seqs) < self.config.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seqs.append(seq)
        self.running.extendleft(reversed(seqs))
        return Batch(seqs, is_prefill=False, forest=self._forest_for(seqs) if self.config.use_fca else None)

    def _forest_for(self, seqs: list[Sequence]) -> PrefixForest:
        key = tuple(s.seq_id for s in seqs)
        if key != self._forest_key or self._forest is None:
            self._forest_key = key
            self._forest = build_forest(
                [s.block_table for s in seqs], [s.num_tokens for s in seqs], self.block_manager.block_size
            )
        return self._forest

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it is recomputed (mostly from the prefix cache) when readmitted."""
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self._forest = None

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)

    def abort(self, request_id) -> list[Sequence]:
        """Drop every sequence of a request, waiting or running; returns them."""
        dropped = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        for seq in dropped:
            if seq.status == SequenceStatus.RUNNING:
                self.finish(seq, "abort")
            else:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
        return dropped
