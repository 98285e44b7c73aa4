"""The core runtime end to end, over HTTP and Ray: real server, Ray actors, DeepSpeed and the native sampler."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import ray
import torch

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client
from arctic_rl_core.errors import JobFailedError
from arctic_rl_core.server.ray_cluster import connect
from tests.e2e.conftest import CPU_TRAINING, run

pytestmark = pytest.mark.slow


def sft_batch(rows: int = 4, length: int = 12, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded row
    return {"args": [ids], "kwargs": {"attention_mask": mask}}


def remote_config(client, **fields) -> ArcticRLClientConfig:
    """A second client of the same server that creates jobs of its own (no new server)."""
    base = client.config
    return ArcticRLClientConfig(
        model_name=base.model_name,
        backend="remote",
        comm_protocol=base.comm_protocol,
        host=base.host,
        port=base.port,
        auth_token=base.auth_token,
        ray_server_name=base.ray_server_name,
        ray_namespace=base.ray_namespace,
        job_ready_timeout=600,
        **fields,
    )


def test_sync_weights_makes_sampling_norm_equal_training_norm(client):
    async def scenario():
        await client.fwd_bwd(sft_batch(), {"loss_fn": "sft"})
        await client.step()
        before = await client.weight_norm()
        sync = await client.sync_weights(cuda_ipc=False)
        after = await client.weight_norm()
        return before, sync, after

    before, sync, after = run(scenario())
    assert abs(before["training_norm"] - before["sampling_norm"]) / before["training_norm"] > 1e-6
    # The shared deployment is split (colocate=False): the WeightSyncCoordinator carries it, over gloo on CPU.
    assert (sync["status"], sync["method"], sync["backend"]) == ("ok", "coordinator", "gloo")
    assert abs(after["training_norm"] - after["sampling_norm"]) / after["training_norm"] < 1e-6


def test_colocated_sync_without_cuda_ipc_goes_through_files(client):
    async def scenario():
        colocated = create_arctic_rl_client(
            remote_config(client, training_gpus=1, sampling_gpus=1, colocate=True, training_config=CPU_TRAINING)
        )
        try:
            await colocated.fwd_bwd(sft_batch(), {"loss_fn": "sft"})
            await colocated.step()
            sync = await colocated.sync_weights(cuda_ipc=False)
            return sync, await colocated.weight_norm()
        finally:
            await colocated.shutdown()

    sync, norms = run(scenario())
    assert (sync["status"], sync["method"]) == ("ok", "file")
    assert abs(norms["training_norm"] - norms["sampling_norm"]) / norms["training_norm"] < 1e-6


def test_log_probs_of_the_log_prob_engine_match_training_fwd_no_grad_on_the_same_text(client):
    """Same weights (the base model) on both engines: same log-probs (fp32, max abs diff < 1e-4)."""

    async def scenario():
        other = create_arctic_rl_client(
            remote_config(
                client, training_gpus=1, log_prob_gpus=1, log_prob_engine="deepspeed", training_config=CPU_TRAINING
            )
        )
        try:
            scored = (await other.log_probs(["The capital of France is"], ["Paris and more"], top_k=2))[0]
            ids = torch.tensor([scored["prompt_token_ids"] + scored["completion_token_ids"]])
            train = await other.fwd_no_grad({"args": [ids]}, reference_model=False)
            batch = sft_batch(rows=3, length=10, seed=7)
            train_batch = await other.fwd_no_grad(batch, reference_model=False)
            ref_batch = await other.fwd_no_grad(batch, reference_model=True)
            return (
                scored,
                train["log_probs_shifted"][0],
                train_batch["log_probs_shifted"],
                ref_batch["log_probs_shifted"],
                batch,
            )
        finally:
            await other.shutdown()

    scored, shifted, train, ref, batch = run(scenario())
    start = len(scored["prompt_token_ids"]) - 1
    expected = shifted[start : start + len(scored["completion_token_ids"])]
    assert (torch.tensor(scored["token_log_probs"]) - expected).abs().max() < 1e-4
    assert len(scored["top_log_probs"]) == len(scored["completion_token_ids"])
    assert all(len(alternatives) == 2 for alternatives in scored["top_log_probs"])
    assert train.shape == batch["args"][0].shape
    assert (train - ref).abs().max() < 1e-4
    assert train[0, :3].eq(0).all()  # padding positions carry no log-prob
    mask = batch["kwargs"]["attention_mask"].bool()
    assert (train[:, :-1][mask[:, :-1] & mask[:, 1:]] < 0).all()


def test_generate_honours_sampling_params_and_returns_logprobs(client):
    results = run(
        client.generate(
            ["What is 1 + 1?", "Hello"], {"max_tokens": 6, "temperature": 0.9, "n": 3, "seed": 11, "top_k": 50}
        )
    )
    assert [r["prompt"] for r in results] == ["What is 1 + 1?", "Hello"]
    for result in results:
        assert len(result["outputs"]) == 3
        for out in result["outputs"]:
            assert 1 <= len(out["token_ids"]) <= 6 and len(out["logprobs"]) == len(out["token_ids"])
            assert all(lp <= 0 for lp in out["logprobs"]) and out["finish_reason"] in ("stop", "length")
    again = run(
        client.generate(["What is 1 + 1?"], {"max_tokens": 6, "temperature": 0.9, "n": 3, "seed": 11, "top_k": 50})
    )
    # Same seed: same tokens. Log-probs agree to float noise (the batch and the prefix cache differ).
    for first, second in zip(results[0]["outputs"], again[0]["outputs"]):
        assert first["token_ids"] == second["token_ids"] and first["text"] == second["text"]
        assert first["logprobs"] == pytest.approx(second["logprobs"], abs=1e-5)


@pytest.mark.parametrize(
    "call, expected",
    [
        (lambda c: c.fwd_bwd({"kwargs": {}}, {"loss_fn": "sft"}), "args"),
        (
            lambda c: c.fwd_bwd(
                {"args": [torch.ones(2, 5, dtype=torch.long)], "kwargs": {"attention_mask": torch.ones(2, 4)}},
                {"loss_fn": "sft"},
            ),
            "attention_mask",
        ),
        (lambda c: c.fwd_bwd(sft_batch(), {"loss_fn": "no_such_loss"}), "no_such_loss"),
        (lambda c: c.fwd_bwd(sft_batch(), {"loss_fn": "os.system"}), "os.system"),
        (lambda c: c.generate(["hi"], {"max_tokens": "many"}), "max_tokens"),
        (
            lambda c: c.fwd_bwd({**sft_batch(), "context": {"advantages": torch.ones(3)}}, {"loss_fn": "grpo"}),
            "advantages",
        ),
    ],
    ids=[
        "missing-args",
        "shape-mismatch",
        "unknown-loss",
        "dotted-path-outside-allowlist",
        "wrong-typed-sampling",
        "bad-context",
    ],
)
def test_bad_input_raises_value_error_naming_the_problem_and_the_next_call_works(client, call, expected):
    with pytest.raises(ValueError, match=expected):
        run(call(client))
    assert run(client.fwd_no_grad(sft_batch(), reference_model=False))["log_probs_shifted"].shape == (4, 12)


def test_http_answers_bad_bodies_with_4xx_naming_the_field(client):
    if client.config.comm_protocol != "http":
        pytest.skip("raw HTTP only")
    base = f"http://{client.config.host}:{client.config.port}"
    headers = {"authorization": f"Bearer {client.config.auth_token}"}
    job = client.training_job_id
    cases = [
        ({"training_job_id": job, "batch": {"kwargs": {}}}, "batch.args"),
        (
            {"training_job_id": job, "batch": {"args": [[[1, 2, 3]]], "kwargs": {"attention_mask": [[1, 1]]}}},
            "attention_mask",
        ),
        (
            {"training_job_id": job, "batch": {"args": [[[1, 2, 3]]]}, "processing": {"loss_fn": "subprocess.call"}},
            "subprocess.call",
        ),
    ]
    for body, expected in cases:
        response = httpx.post(f"{base}/fwd-bwd", json=body, headers=headers, timeout=60)
        assert 400 <= response.status_code < 500, response.text
        assert expected in response.json()["detail"]
    response = httpx.post(
        f"{base}/generate",
        json={"sampling_job_id": client.sampling_job_id, "prompts": ["x"], "sampling_params": {"n": "two"}},
        headers=headers,
        timeout=60,
    )
    assert response.status_code == 422 and "sampling_params.n" in response.json()["detail"]
    assert httpx.post(f"{base}/step", json={"training_job_id": job}, timeout=10).status_code == 401
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_job_ids_raise_value_error_when_the_job_does_not_exist(client):
    async def scenario():
        other = create_arctic_rl_client(remote_config(client, training_gpus=1, training_config=CPU_TRAINING))
        try:
            assert isinstance(other.training_job_id, int)
            with pytest.raises(ValueError, match="sampling"):
                other.sampling_job_id
            with pytest.raises(ValueError, match="log_prob"):
                other.log_prob_job_id
            assert await other.sleep_log_prob() == {"status": "no_log_prob_job"}
            assert await other.wake_log_prob() == {"status": "no_log_prob_job"}
            with pytest.raises(ValueError, match="sampling"):
                await other.generate(["x"])
        finally:
            await other.shutdown()
        with pytest.raises(ValueError):
            other.training_job_id

    run(scenario())


def test_killing_a_training_worker_fails_the_job_and_calls_raise_within_seconds(client):
    async def scenario():
        other = create_arctic_rl_client(remote_config(client, training_gpus=1, training_config=CPU_TRAINING))
        try:
            status = await other.status()
            job = next(j for j in status["jobs"] if j["job_id"] == other.training_job_id)
            os.kill(job["pids"][0], signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(JobFailedError, match=f"training job {other.training_job_id}"):
                while True:
                    await other.fwd_no_grad(sft_batch(), reference_model=False)
                    await asyncio.sleep(0.2)
            elapsed = time.monotonic() - started
            status = await other.status()
            job = next(j for j in status["jobs"] if j["job_id"] == other.training_job_id)
            return elapsed, job
        finally:
            await other.shutdown()

    elapsed, job = run(scenario())
    assert job["state"] == "FAILED" and "died" in job["error"]
    assert elapsed < 10


def test_reconnect_config_works_from_inside_another_ray_actor(client):
    config = client.reconnect_config()
    assert config.backend == "local" and config.training_job_id == client.training_job_id
    if client.config.comm_protocol == "ray":
        assert config.comm_protocol == "ray" and config.host is None

    @ray.remote(num_cpus=0)
    class Trainer:
        def run(self, cfg):
            from arctic_rl_core import create_arctic_rl_client as make

            actor_client = make(cfg)
            result = asyncio.run(actor_client.weight_norm())
            return actor_client.training_job_id, result["training_norm"]

    # The same kind of cluster the Ray protocol starts (CPU stand-ins for GPUs), should it run next.
    connect(auto_attach=False)
    job_id, norm = ray.get(Trainer.remote().run.remote(config))
    assert job_id == client.training_job_id
    assert norm == pytest.approx(run(client.weight_norm())["training_norm"], rel=1e-12)


def _workers_by_job(server) -> list[tuple[str, object]]:
    jobs = [job for job in server.manager.jobs.values() if job.state.value == "RUNNING"]
    return [(job.name, worker) for job in jobs for worker in job.workers]


def _engine_thread_after(_worker, seconds: float) -> int:
    import threading
    import time

    time.sleep(seconds)
    return threading.get_ident()


def test_engine_calls_on_a_worker_share_one_thread_and_liveness_calls_never_wait(client):
    """CUDA libraries keep per-thread state on the device; engine calls spread over threads would multiply it."""
    if client.config.comm_protocol != "ray":
        pytest.skip("reads the worker actors through the Ray server")
    from arctic_rl_core.server.jobs import CONTROL

    workers = ray.get(client._transport.actor.__ray_call__.remote(_workers_by_job))
    training = [w for name, w in workers if name.startswith("training")]
    assert training
    for worker in training:
        calls = [worker.__ray_call__.remote(_engine_thread_after, 1.0) for _ in range(4)]  # sent at once
        info = ray.get(worker.info.options(concurrency_group=CONTROL).remote(), timeout=3.0)
        done, _ = ray.wait(calls, num_returns=4, timeout=0)
        assert len(done) < 4  # answered while engine calls were still queued (4 s of them, one at a time)
        assert len(set(ray.get(calls))) == 1, "engine calls ran on more than one thread"
        assert info["pid"] > 0


def test_full_determinism_gives_bit_identical_losses_across_two_runs(client):
    async def losses():
        other = create_arctic_rl_client(
            remote_config(client, training_gpus=1, training_config=CPU_TRAINING, full_determinism=True, seed=5)
        )
        try:
            values = []
            for step in range(2):
                out = await other.fwd_bwd(sft_batch(seed=step), {"loss_fn": "sft"})
                await other.step()
                values.append(out["loss"])
            return values
        finally:
            await other.shutdown()

    first, second = run(losses()), run(losses())
    assert first == second
    assert first[0] != first[1]


def test_checkpoint_save_and_resume_restores_weights_and_step(client, tmp_path):
    async def scenario():
        trained = create_arctic_rl_client(remote_config(client, training_gpus=1, training_config=CPU_TRAINING))
        try:
            await trained.fwd_bwd(sft_batch(), {"loss_fn": "sft"})
            await trained.step()
            saved = await trained.save_checkpoint(path=str(tmp_path / "ckpt"))
            norm = (await trained.weight_norm())["training_norm"]
        finally:
            await trained.shutdown()
        resumed = create_arctic_rl_client(
            remote_config(client, training_gpus=1, training_config=CPU_TRAINING, checkpoint_path=str(tmp_path / "ckpt"))
        )
        try:
            resumed_norm = (await resumed.weight_norm())["training_norm"]
            await resumed.fwd_bwd(sft_batch(), {"loss_fn": "sft"})
            step = await resumed.step()
        finally:
            await resumed.shutdown()
        return saved, norm, resumed_norm, step

    saved, norm, resumed_norm, step = run(scenario())
    assert saved["step"] == 1 and (tmp_path / "ckpt" / "latest").read_text() == "global_step1"
    assert resumed_norm == norm
    assert step["step"] == 2
