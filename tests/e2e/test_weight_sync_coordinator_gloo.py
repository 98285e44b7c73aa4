"""The WeightSyncCoordinator between 2 "training" and 2 "inference" processes over gloo, as on a CPU box.

Every scenario runs for real: separate processes, a TCPStore rendezvous, gloo
sends and all-gathers. The expected shards are written out here by hand from
the Megatron/vLLM layouts, independently of ``tp_resharding``.
"""

from __future__ import annotations

import json
import os
import socket
import time
import types
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from arctic_rl_core.config import WeightSyncConfig
from arctic_rl_core.weight_sync import (
    AttentionHeads,
    TrainingRank,
    TransferSchedule,
    WeightMismatchError,
    WeightSyncCoordinator,
    WeightSyncError,
    flat_partition,
)

# (training_sharding, inference_tp): 2 inference processes are 2 replicas of tp 1, or 1 replica of tp 2.
SCENARIOS = [("dp", 1), ("dp", 2), ("fsdp", 1), ("fsdp", 2)]
SYNCS_PER_SCENARIO = 3
# Small enough that the tiny model spans many buckets, and the embeddings overflow one.
BUCKET_SIZE = 64 * 1024
WORLD = 4
KILL_TIMEOUT_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(sharding: str, tp: int, port: int, timeout_s: float = 30.0) -> WeightSyncConfig:
    return WeightSyncConfig(
        training_sharding=sharding,
        training_gpus=2,
        inference_replicas=2 // tp,
        inference_tp=tp,
        base_port=port,
        bucket_size=BUCKET_SIZE,
        timeout_s=timeout_s,
    )


def _weights(model_dir: str, sync: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights, shifted per sync so each sync carries new values; norms fp32, the rest bf16."""
    from safetensors.torch import load_file

    full = load_file(Path(model_dir) / "model.safetensors")
    return {n: (t + sync).to(torch.float32 if "norm" in n else torch.bfloat16) for n, t in full.items()}


def _heads(model_dir: str) -> AttentionHeads:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return AttentionHeads.from_hf_config(types.SimpleNamespace(head_dim=None, **config))


def _expected_shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The tiny qwen2 layout (2 query heads, 1 kv head, head_dim 64) on rank ``tp_rank`` of ``tp``."""
    if tp == 1 or "norm" in name:
        return full
    if "k_proj" in name or "v_proj" in name:
        return full  # one kv head, replicated to both ranks
    if "o_proj" in name or "down_proj" in name:
        return full.chunk(tp, dim=1)[tp_rank]
    # q_proj (by query head), gate/up (by row), embed_tokens/lm_head (by vocabulary row)
    return full.chunk(tp, dim=0)[tp_rank]


def _run_member(member, coordinator: WeightSyncCoordinator, weights: dict, sharding: str) -> str | None:
    """One sync from ``member``'s side; returns what differs from the expected shards (None: bit-exact)."""
    if isinstance(member, TrainingRank):
        if sharding == "fsdp":
            coordinator.send([(n, flat_partition(t, member.rank, 2)) for n, t in weights.items()])
        else:
            coordinator.send(weights.items())
        return None
    tp = coordinator.schedule.tp
    expected = {n: _expected_shard(n, t, member.tp_rank, tp) for n, t in weights.items()}
    received = {n: t.clone() for n, t in coordinator.receive({n: t.shape for n, t in expected.items()})}
    if received.keys() != expected.keys():
        return f"names differ: {sorted(received.keys() ^ expected.keys())}"
    wrong = [n for n, t in expected.items() if not (received[n].dtype == t.dtype and torch.equal(received[n], t))]
    return f"values differ: {wrong}" if wrong else None


def _sync_scenarios(group_rank: int, model_dir: str, ports: list[int], results) -> None:
    heads = _heads(model_dir)
    for (sharding, tp), port in zip(SCENARIOS, ports):
        config = _config(sharding, tp, port)
        member = TransferSchedule.from_config(config).member(group_rank)
        try:
            with WeightSyncCoordinator(config, member, heads=heads) as coordinator:
                problems = [
                    _run_member(member, coordinator, _weights(model_dir, sync), sharding)
                    for sync in range(SYNCS_PER_SCENARIO)
                ]
            results.put(("sync", (sharding, tp), str(member), [p for p in problems if p]))
        except Exception as e:  # reported to the parent, which fails the test with it
            results.put(("sync", (sharding, tp), str(member), [repr(e)]))


def _refused_then_accepted(group_rank: int, model_dir: str, port: int, results) -> None:
    config = _config("dp", 1, port)
    member = TransferSchedule.from_config(config).member(group_rank)
    weights = _weights(model_dir, 0)
    with WeightSyncCoordinator(config, member) as coordinator:
        try:
            if isinstance(member, TrainingRank):
                coordinator.send(weights.items())
            else:
                expected = {n: t.shape for n, t in weights.items()}
                if member.replica == 1:
                    expected["model.extra.weight"] = (3,)
                    expected["model.norm.weight"] = (7,)
                coordinator.receive(expected)
            refusal = None
        except WeightMismatchError as e:
            refusal = str(e)
        # The group is still in step after a refusal: the next sync goes through.
        after = _run_member(member, coordinator, weights, "dp")
    results.put(("refusal", str(member), refusal, after))


def _peer_dies(case: str, group_rank: int, config: WeightSyncConfig, victim: int, model_dir: str, results) -> None:
    """One good sync, then ``victim`` exits and the others sync again: they must raise, within the timeout."""
    member = TransferSchedule.from_config(config).member(group_rank)
    weights = _weights(model_dir, 0)
    coordinator = WeightSyncCoordinator(config, member)
    _run_member(member, coordinator, weights, "dp")
    if group_rank == victim:
        results.close()
        results.join_thread()
        os._exit(0)
    start = time.monotonic()
    try:
        _run_member(member, coordinator, weights, "dp")
        outcome = None
    except WeightSyncError as e:
        outcome = (type(e).__name__, e.step, str(e))
    results.put(("dead peer", case, str(member), outcome, time.monotonic() - start))


def _member_main(group_rank: int, model_dir: str, ports: list[int], results) -> None:
    """Everything one of the 4 processes does; a single spawn keeps the suite fast on a small CPU box."""
    _sync_scenarios(group_rank, model_dir, ports[: len(SCENARIOS)], results)
    _refused_then_accepted(group_rank, model_dir, ports[-3], results)
    # An inference worker dies: the others wait for its verdict until the timeout.
    config = _config("dp", 1, ports[-2], timeout_s=KILL_TIMEOUT_S)
    _peer_dies("inference replica 1", group_rank, config, 3, model_dir, results)
    # The survivors regroup (2 training ranks, 1 inference worker); training rank 0, which hosts the store, dies.
    config = WeightSyncConfig(training_gpus=2, base_port=ports[-1], bucket_size=BUCKET_SIZE, timeout_s=KILL_TIMEOUT_S)
    _peer_dies("training rank 0", group_rank, config, 0, model_dir, results)


@pytest.fixture(scope="module")
def results(tiny_model) -> list[tuple]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [_free_port() for _ in range(len(SCENARIOS) + 3)]
    procs = [ctx.Process(target=_member_main, args=(rank, tiny_model, ports, queue)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    out = []
    deadline = time.monotonic() + 240
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        while not queue.empty():
            out.append(queue.get())
        time.sleep(0.05)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    while not queue.empty():
        out.append(queue.get())
    assert not hung, f"processes {hung} hung"
    return out


@pytest.mark.parametrize("sharding,tp", SCENARIOS)
def test_coordinator_moves_tiny_model_bit_exact(results, sharding, tp):
    members = {r[2]: r[3] for r in results if r[0] == "sync" and r[1] == (sharding, tp)}
    assert len(members) == WORLD, members
    assert all(problems == [] for problems in members.values()), members


def test_receiver_mismatch_refuses_on_every_member_and_names_the_offenders(results):
    refusals = [r[1:] for r in results if r[0] == "refusal"]
    assert len(refusals) == WORLD
    for member, refusal, after in refusals:
        assert refusal is not None, f"{member} was not refused"
        assert "inference replica 1 tp rank 0" in refusal
        assert "model.extra.weight" in refusal and "model.norm.weight [128] (expected [7])" in refusal
        assert after is None, f"{member}: the sync after the refusal failed: {after}"


@pytest.mark.parametrize("case,survivors", [("inference replica 1", 3), ("training rank 0", 2)])
def test_killing_a_peer_raises_within_the_timeout(results, case, survivors):
    outcomes = [r[2:] for r in results if r[0] == "dead peer" and r[1] == case]
    assert len(outcomes) == survivors, outcomes
    for member, outcome, elapsed in outcomes:
        assert outcome is not None, f"{member} did not notice that {case} died"
        kind, step, message = outcome
        assert kind == "WeightSyncError" and step in ("manifest", "validate"), outcome
        assert elapsed < KILL_TIMEOUT_S + 2.0, f"{member} took {elapsed:.1f} s"
