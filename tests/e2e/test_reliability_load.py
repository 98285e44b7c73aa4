"""Load: 8 clients at once on one server, each with 100 generate calls and 20 fwd_bwd/step pairs, while weight syncs
run and /health is polled. Every call returns its own correct result; nothing is lost or served twice.

The clients share one training job, whose calls the server serializes. Gradients accumulate per job: a step applies
whatever any client accumulated since the previous step, and a step that finds nothing (another client's step took
it) is refused with a 400. So the pairs interleave freely, and the accounting is checked instead: every step is
applied once or refused, and the applied steps together consumed every fwd_bwd's micro-batches exactly once.

The training job's learning rate (1e-30) is far below the float32 spacing of the weights: every step runs the
whole optimizer path yet leaves the weights bit-identical. So however the calls interleave, each fwd_bwd has one
right loss (its batch's, measured alone beforehand), the syncs keep the sampler on the same weights, and every
sampled token can be checked against the training engine's log-prob of it.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from arctic_rl_core import create_arctic_rl_client
from arctic_rl_core.client.http import ArcticRLRequestError
from tests.e2e.conftest import run
from tests.e2e.test_core_runtime import remote_config, sft_batch

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("client", ["http"], indirect=True)]

CLIENTS, GENERATES, PAIRS, SYNCS = 8, 100, 20, 3
FROZEN_TRAINING = {"dtype": "float32", "optimizer": {"lr": 1e-30}}
SFT = {"loss_fn": "sft"}


class HealthProbe(threading.Thread):
    """GET /health every 50 ms from its own thread and connection, recording status and latency."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.answers, self.done = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self.done.is_set():
                started = time.monotonic()
                self.answers.append((http.get(self.url).status_code, time.monotonic() - started))
                time.sleep(0.05)


@pytest.fixture(scope="module")
def owner(client):
    """Jobs of this test's own on the shared server: a frozen training job and a sampler."""
    owner = create_arctic_rl_client(
        remote_config(client, training_gpus=1, sampling_gpus=1, training_config=FROZEN_TRAINING)
    )
    yield owner
    run(owner.shutdown())


def test_eight_clients_get_every_result_once_and_correct_while_syncs_run_and_health_answers(client, owner):
    batches = [sft_batch(rows=2, length=8, seed=100 + i) for i in range(CLIENTS)]

    async def prepare():
        expected = [(await owner.fwd_bwd(batch, SFT))["loss"] for batch in batches]
        first_step = (await owner.step())["step"]
        return expected, first_step, await owner.weight_norm(), await owner.status()

    expected, first_step, norm_before, status_before = run(prepare())
    clients = [create_arctic_rl_client(owner.reconnect_config()) for _ in range(CLIENTS)]
    health = HealthProbe(f"http://{client.config.host}:{client.config.port}/health")

    async def load():
        generated: list[list] = [[] for _ in range(CLIENTS)]
        trained: list[list] = [[] for _ in range(CLIENTS)]
        steps: list[list] = [[] for _ in range(CLIENTS)]
        generate_starts: list[float] = []
        sync_spans: list[tuple[float, float]] = []

        async def one_client(i: int) -> None:
            c = clients[i]
            for j in range(GENERATES):
                prompt = f"client {i} call {j}:"
                generate_starts.append(time.monotonic())
                result = await c.generate([prompt], {"max_tokens": 3, "seed": 1000 * i + j})
                generated[i].append((prompt, result))
                if j % (GENERATES // PAIRS) == 0:
                    trained[i].append(await c.fwd_bwd(batches[i], SFT))
                    try:
                        steps[i].append(await c.step())
                    except ArcticRLRequestError as refused:
                        steps[i].append(refused)

        async def syncs() -> None:
            for _ in range(SYNCS):
                await asyncio.sleep(1.0)
                started = time.monotonic()
                assert (await owner.sync_weights(cuda_ipc=False))["status"] == "ok"
                sync_spans.append((started, time.monotonic()))

        await asyncio.gather(syncs(), *(one_client(i) for i in range(CLIENTS)))
        return generated, trained, steps, generate_starts, sync_spans

    health.start()
    started = time.monotonic()
    try:
        generated, trained, steps, generate_starts, sync_spans = run(load())
    finally:
        health.done.set()
        health.join()
    elapsed = time.monotonic() - started

    async def inspect():
        return await owner.status(), await owner.weight_norm()

    status_after, norm_after = run(inspect())

    # Counted per client: every call answered once, with its own prompt and its own batch's loss.
    for i in range(CLIENTS):
        assert len(generated[i]) == GENERATES and len(trained[i]) == PAIRS and len(steps[i]) == PAIRS
        for prompt, result in generated[i]:
            assert len(result) == 1 and result[0]["prompt"] == prompt and len(result[0]["outputs"]) == 1
            out = result[0]["outputs"][0]
            assert 1 <= len(out["token_ids"]) <= 3 and len(out["logprobs"]) == len(out["token_ids"])
        assert [r["loss"] for r in trained[i]] == pytest.approx([expected[i]] * PAIRS, rel=1e-6)
    # Counted across clients: each step was applied once (consecutive numbers) or refused for want of gradients,
    # and the applied steps consumed every micro-batch the fwd_bwd calls accumulated, once.
    outcomes = [outcome for per_client in steps for outcome in per_client]
    applied = [o for o in outcomes if isinstance(o, dict)]
    refused = [o for o in outcomes if not isinstance(o, dict)]
    assert all(o.status == 400 and "no gradients" in str(o) for o in refused), refused
    assert sorted(o["step"] for o in applied) == list(range(first_step + 1, first_step + 1 + len(applied)))
    accumulated = sum(r["micro_batches"] for per_client in trained for r in per_client)
    assert sum(o["micro_batches"] for o in applied) == accumulated == CLIENTS * PAIRS
    # Counted by the server: what it dispatched during the load is exactly what the clients sent.
    served = {
        op: status_after["served"].get(op, 0) - status_before["served"].get(op, 0)
        for op in ("generate", "fwd_bwd", "step", "sync_weights")
    }
    assert served == {
        "generate": CLIENTS * GENERATES,
        "fwd_bwd": CLIENTS * PAIRS,
        "step": CLIENTS * PAIRS,
        "sync_weights": SYNCS,
    }
    sampler_calls = [
        next(j["calls"] for j in s["jobs"] if j["job_id"] == owner.sampling_job_id)
        for s in (status_before, status_after)
    ]
    assert sampler_calls[1] - sampler_calls[0] == CLIENTS * GENERATES + SYNCS  # a sync loads weights: one call

    # The weights never moved, and the syncs did not wait for the rollouts to end: generate calls began after each.
    assert norm_after == norm_before
    assert all(any(t > end for t in generate_starts) for _, end in sync_spans), (sync_spans, max(generate_starts))
    assert len(health.answers) > 0 and all(code == 200 for code, _ in health.answers)

    # Correct results: each sampled token's log-prob is the training engine's log-prob of it after its own prompt.
    rows = [(r[0]["prompt_token_ids"], r[0]["outputs"][0]) for per_client in generated for _, r in per_client]
    width = max(len(ids) + len(out["token_ids"]) for ids, out in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (ids, out) in enumerate(rows):
        sequence = ids + out["token_ids"]
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    scored = run(owner.fwd_no_grad({"args": [input_ids], "kwargs": {"attention_mask": mask}}, reference_model=False))
    for row, (ids, out) in enumerate(rows):
        expected_lps = scored["log_probs_shifted"][row, len(ids) - 1 : len(ids) - 1 + len(out["token_ids"])]
        assert torch.allclose(torch.tensor(out["logprobs"]), expected_lps, atol=1e-4), (row, out, expected_lps)

    slowest_health = max(latency for _, latency in health.answers)
    print(f"load: {elapsed:.1f}s for {CLIENTS * (GENERATES + 2 * PAIRS)} calls + {SYNCS} syncs; "
          f"{len(applied)} steps applied, {len(refused)} refused (nothing left to apply); "
          f"/health answered {len(health.answers)} times, slowest {slowest_health * 1000:.0f} ms")  # fmt: skip


def test_a_weight_sync_is_not_starved_by_a_continuous_stream_of_generate_calls(client, owner):
    """Rollouts that never pause (async RL) keep some generate call in flight at every instant; the sync must still
    get its turn: generate calls that arrive after it queue behind it."""
    streams, deadline_s = 16, 60.0

    async def scenario():
        stop = asyncio.Event()
        generated = 0

        async def stream(k: int) -> None:
            nonlocal generated
            while not stop.is_set():
                # Lengths vary, so the streams' calls end at different steps and overlap without a gap.
                await owner.generate([f"stream {k}:"], {"max_tokens": 1 + (k + generated) % 16, "ignore_eos": True})
                generated += 1

        tasks = [asyncio.ensure_future(stream(k)) for k in range(streams)]
        await asyncio.sleep(2.0)  # every stream is going
        started = time.monotonic()
        sync = asyncio.ensure_future(owner.sync_weights(cuda_ipc=False))
        done, _ = await asyncio.wait({sync}, timeout=deadline_s)
        waited = time.monotonic() - started
        during = generated
        stop.set()
        await asyncio.gather(*tasks)
        await sync
        return bool(done), waited, during

    finished_under_load, waited, generated = run(scenario())
    assert finished_under_load, f"the sync waited the whole {deadline_s}s while {generated} generate calls ran"
    print(f"sync under {streams} continuous generate streams: {waited:.2f}s")
