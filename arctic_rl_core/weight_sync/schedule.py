"""Who sends what to whom in a split-placement sync.

The coordinator's process group has ``training_gpus`` training ranks (group
ranks 0..T-1) followed by ``inference_replicas x inference_tp`` inference
workers (group rank T + replica * tp + tp_rank). Each inference worker, a
target, receives its tensor-parallel shard from exactly one training rank.

Targets are taken tp-rank-major and cut into contiguous, nearly equal runs,
one per training rank: the load spreads over all senders, and a sender whose
targets share a tp rank packs each bucket once and sends it several times.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Union

from arctic_rl_core.config import WeightSyncConfig


@dataclass(frozen=True, order=True)
class TrainingRank:
    rank: int

    def __str__(self) -> str:
        return f"training rank {self.rank}"


@dataclass(frozen=True, order=True)
class InferenceTarget:
    replica: int
    tp_rank: int

    def __str__(self) -> str:
        return f"inference replica {self.replica} tp rank {self.tp_rank}"


Member = Union[TrainingRank, InferenceTarget]


@dataclass(frozen=True)
class TransferSchedule:
    training_ranks: int
    replicas: int
    tp: int

    @classmethod
    def from_config(cls, config: WeightSyncConfig) -> "TransferSchedule":
        return cls(config.training_gpus, config.inference_replicas, config.inference_tp)

    @property
    def world_size(self) -> int:
        return self.training_ranks + self.replicas * self.tp

    @cached_property
    def targets(self) -> tuple[InferenceTarget, ...]:
        return tuple(InferenceTarget(r, p) for r in range(self.replicas) for p in range(self.tp))

    @cached_property
    def _senders(self) -> dict[InferenceTarget, int]:
        by_tp_rank = sorted(self.targets, key=lambda t: (t.tp_rank, t.replica))
        base, extra = divmod(len(by_tp_rank), self.training_ranks)
        senders: dict[InferenceTarget, int] = {}
        start = 0
        for rank in range(self.training_ranks):
            count = base + (rank < extra)
            senders.update({t: rank for t in by_tp_rank[start : start + count]})
            start += count
        return senders

    def check(self, member: Member) -> None:
        """Raise ``ValueError`` naming the field when ``member`` is not part of this topology."""
        if isinstance(member, TrainingRank):
            if not 0 <= member.rank < self.training_ranks:
                raise ValueError(
                    f"training rank must be in [0, training_gpus={self.training_ranks}), got {member.rank}"
                )
        elif isinstance(member, InferenceTarget):
            if not 0 <= member.replica < self.replicas:
                raise ValueError(f"replica must be in [0, inference_replicas={self.replicas}), got {member.replica}")
            if not 0 <= member.tp_rank < self.tp:
                raise ValueError(f"tp_rank must be in [0, inference_tp={self.tp}), got {member.tp_rank}")
        else:
            raise TypeError(f"member must be a TrainingRank or an InferenceTarget, got {type(member).__name__}")

    def group_rank(self, member: Member) -> int:
        self.check(member)
        if isinstance(member, TrainingRank):
            return member.rank
        return self.training_ranks + member.replica * self.tp + member.tp_rank

    def member(self, group_rank: int) -> Member:
        if group_rank < self.training_ranks:
            return TrainingRank(group_rank)
        replica, tp_rank = divmod(group_rank - self.training_ranks, self.tp)
        return InferenceTarget(replica, tp_rank)

    def sender(self, target: InferenceTarget) -> int:
        """The training rank that sends to ``target``."""
        self.check(target)
        return self._senders[target]

    def targets_of(self, training_rank: int) -> tuple[InferenceTarget, ...]:
        """The targets ``training_rank`` sends to, ordered by tp rank then replica."""
        return tuple(t for t, s in self._senders.items() if s == training_rank)
