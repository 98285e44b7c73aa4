from collections import Counter

import pytest

from arctic_rl_core.config import WeightSyncConfig
from arctic_rl_core.weight_sync import InferenceTarget, TrainingRank, TransferSchedule


@pytest.mark.parametrize("training,replicas,tp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2), (3, 4, 2), (8, 2, 2)])
def test_every_target_has_one_sender_and_the_load_is_balanced(training, replicas, tp):
    schedule = TransferSchedule(training, replicas, tp)
    senders = {t: schedule.sender(t) for t in schedule.targets}
    assert len(senders) == replicas * tp
    assert all(0 <= s < training for s in senders.values())
    load = Counter(senders.values())
    counts = [load.get(rank, 0) for rank in range(training)]
    assert max(counts) - min(counts) <= 1
    for rank in range(training):
        assert schedule.targets_of(rank) == tuple(t for t in schedule.targets_of(rank) if senders[t] == rank)
        mine = list(schedule.targets_of(rank))
        assert sorted(mine, key=lambda t: (t.tp_rank, t.replica)) == mine


def test_a_sender_serves_one_tp_rank_when_the_topology_allows_it():
    schedule = TransferSchedule(training_ranks=2, replicas=2, tp=2)
    assert schedule.targets_of(0) == (InferenceTarget(0, 0), InferenceTarget(1, 0))
    assert schedule.targets_of(1) == (InferenceTarget(0, 1), InferenceTarget(1, 1))


def test_group_ranks_put_training_first_then_replicas_in_order():
    schedule = TransferSchedule.from_config(WeightSyncConfig(training_gpus=2, inference_replicas=2, inference_tp=2))
    assert schedule.world_size == 6
    members = [TrainingRank(0), TrainingRank(1), InferenceTarget(0, 0), InferenceTarget(0, 1), InferenceTarget(1, 0),
               InferenceTarget(1, 1)]  # fmt: skip
    assert [schedule.group_rank(m) for m in members] == list(range(6))
    assert [schedule.member(r) for r in range(6)] == members


def test_members_outside_the_topology_are_refused_by_field():
    schedule = TransferSchedule(2, 1, 2)
    with pytest.raises(ValueError, match=r"training rank must be in \[0, training_gpus=2\), got 2"):
        schedule.check(TrainingRank(2))
    with pytest.raises(ValueError, match=r"replica must be in \[0, inference_replicas=1\), got 1"):
        schedule.check(InferenceTarget(1, 0))
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, inference_tp=2\), got 2"):
        schedule.check(InferenceTarget(0, 2))
