"""The coordinator's guards, with every member as a thread of this process (gloo works across threads too)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from arctic_rl_core.config import WeightSyncConfig
from arctic_rl_core.weight_sync import (
    AttentionHeads,
    FlatShard,
    InferenceTarget,
    TrainingRank,
    TransferSchedule,
    WeightMismatchError,
    WeightSyncCoordinator,
    WeightSyncError,
    flat_partition,
)

WEIGHTS = {"model.layers.0.mlp.up_proj.weight": torch.arange(64.0).view(8, 8), "model.norm.weight": torch.ones(8)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _members(config: WeightSyncConfig, act) -> dict[str, object]:
    """Run ``act(coordinator)`` on every member, each in its own thread; {member: result or exception}."""
    schedule = TransferSchedule.from_config(config)
    outcomes: dict[str, object] = {}

    def run(rank: int) -> None:
        member = schedule.member(rank)
        try:
            with WeightSyncCoordinator(config, member) as coordinator:
                outcomes[str(member)] = act(coordinator)
        except Exception as e:
            outcomes[str(member)] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(schedule.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a member hung"
    return outcomes


def test_one_training_rank_and_one_inference_worker_sync_bit_exact():
    config = WeightSyncConfig(base_port=_free_port(), bucket_size=1024, timeout_s=10)

    def act(c: WeightSyncCoordinator):
        if isinstance(c.member, TrainingRank):
            return c.send(WEIGHTS.items())
        return {n: t.clone() for n, t in c.receive({n: t.shape for n, t in WEIGHTS.items()})}

    received = _members(config, act)["inference replica 0 tp rank 0"]
    assert received.keys() == WEIGHTS.keys() and all(torch.equal(received[n], WEIGHTS[n]) for n in WEIGHTS)


def test_a_receiver_that_stops_consuming_makes_the_sender_raise_naming_the_bucket():
    config = WeightSyncConfig(base_port=_free_port(), bucket_size=1024, timeout_s=1.0)

    def act(c: WeightSyncCoordinator):
        if isinstance(c.member, TrainingRank):
            start = time.monotonic()
            try:
                c.send(WEIGHTS.items())
            except WeightSyncError as e:
                return e, time.monotonic() - start
            return None
        c.receive({n: t.shape for n, t in WEIGHTS.items()})  # validated, then never iterated
        time.sleep(2.0)
        return None

    outcome = _members(config, act)["training rank 0"]
    assert outcome is not None, "the sender did not notice the stalled receiver"
    error, elapsed = outcome
    assert error.step == "send bucket 1/1 to inference replica 0 tp rank 0"
    assert elapsed < 1.0 + 1.0


def test_a_wrong_fsdp_partition_is_refused_by_every_member_naming_the_rank():
    config = WeightSyncConfig(training_sharding="fsdp", training_gpus=2, base_port=_free_port(), timeout_s=10)

    def act(c: WeightSyncCoordinator):
        if isinstance(c.member, TrainingRank):
            shards = [(n, flat_partition(t, c.member.rank, 2)) for n, t in WEIGHTS.items()]
            if c.member.rank == 1:
                shards[0] = (shards[0][0], FlatShard(torch.zeros(5), (8, 8)))
            return c.send(shards)
        return list(c.receive({n: t.shape for n, t in WEIGHTS.items()}))

    outcomes = _members(config, act)
    assert len(outcomes) == 3
    for member, outcome in outcomes.items():
        assert isinstance(outcome, WeightMismatchError), (member, outcome)
        assert "training rank 1: model.layers.0.mlp.up_proj.weight: partition of shape [5], expected 1-D of 32" in str(
            outcome
        )


def test_a_training_rank_whose_weights_differ_from_rank_0_is_refused():
    config = WeightSyncConfig(training_gpus=2, base_port=_free_port(), timeout_s=10)

    def act(c: WeightSyncCoordinator):
        if isinstance(c.member, TrainingRank):
            weights = dict(WEIGHTS)
            if c.member.rank == 1:
                weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.bfloat16)
            return c.send(weights.items())
        return list(c.receive({n: t.shape for n, t in WEIGHTS.items()}))

    for outcome in _members(config, act).values():
        assert isinstance(outcome, WeightMismatchError)
        assert "training rank 1: its dtypes differ from training rank 0's: model.norm.weight torch.bfloat16" in str(
            outcome
        )


def test_construction_refuses_what_it_cannot_serve():
    config = WeightSyncConfig(inference_tp=2, base_port=_free_port())
    with pytest.raises(ValueError, match="heads is required on training rank 0 when inference_tp=2"):
        WeightSyncCoordinator(config, TrainingRank(0))
    with pytest.raises(ValueError, match=r"replica must be in \[0, inference_replicas=1\), got 1"):
        WeightSyncCoordinator(config, InferenceTarget(1, 0))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available; use device='cpu'"):
            WeightSyncCoordinator(config, TrainingRank(0), device="cuda", heads=AttentionHeads(2, 1, 4))


def test_a_member_nobody_meets_raises_at_rendezvous():
    config = WeightSyncConfig(inference_replicas=1, base_port=_free_port(), timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        WeightSyncCoordinator(config, TrainingRank(0))
    assert info.value.step == "rendezvous" and time.monotonic() - start < 3.0
