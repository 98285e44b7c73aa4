"""Faults on a shared server: a training rank that dies fails its job and every call within seconds, the job can be
created again on the same server, and a rank killed mid-save leaves the previous checkpoint whole and resumable.

Each test makes jobs of its own on the session's HTTP deployment (a second client, ``remote_config``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from arctic_rl_core import create_arctic_rl_client
from arctic_rl_core.errors import JobFailedError
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from tests.e2e.conftest import CPU_TRAINING, run
from tests.e2e.test_core_runtime import remote_config, sft_batch

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("client", ["http"], indirect=True)]

SFT = {"loss_fn": "sft"}


def long_batch(rows: int, length: int) -> dict:
    """Seconds of work for the tiny model on CPU: long enough to be killed in the middle of."""
    return {"args": [torch.randint(3, 1000, (rows, length), generator=torch.Generator().manual_seed(3))]}


async def job_status(client, job_id: int) -> dict:
    return next(job for job in (await client.status())["jobs"] if job["job_id"] == job_id)


async def until(predicate, timeout: float = 60.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while not (value := await predicate()):
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(interval)
    return value


def test_a_rank_killed_mid_fwd_bwd_fails_the_job_and_every_pending_call_within_10_s_and_a_new_job_continues(
    client, tmp_path
):
    config = remote_config(client, training_gpus=2, training_config=CPU_TRAINING)

    async def doomed_job():
        doomed = create_arctic_rl_client(config)
        job_id = doomed.training_job_id
        try:
            # A save refused on rank 0 is refused on every rank: none is left waiting in a collective.
            (tmp_path / "a-file").write_text("")
            with pytest.raises(ValueError, match="path="):
                await doomed.save_checkpoint(path=str(tmp_path / "a-file" / "checkpoints"))
            await doomed.fwd_bwd(sft_batch(), SFT)
            pids = (await job_status(doomed, job_id))["pids"]
            calls = (await job_status(doomed, job_id))["calls"]
            served = (await doomed.status())["served"].get("fwd_bwd", 0)
            running = asyncio.ensure_future(doomed.fwd_bwd(long_batch(16, 1024), SFT))
            pending = asyncio.ensure_future(doomed.fwd_bwd(long_batch(16, 1024), SFT))

            async def one_running_one_queued():
                status = await doomed.status()
                job = next(j for j in status["jobs"] if j["job_id"] == job_id)
                return status["served"].get("fwd_bwd", 0) == served + 2 and job["calls"] == calls + 1

            await until(one_running_one_queued)
            assert not running.done()
            os.kill(pids[1], signal.SIGKILL)
            killed_at = time.monotonic()
            outcomes = await asyncio.gather(running, pending, return_exceptions=True)
            failed_within = time.monotonic() - killed_at
            started = time.monotonic()
            with pytest.raises(JobFailedError, match=f"training job {job_id} is FAILED"):
                await doomed.step()
            later_call_failed_within = time.monotonic() - started
            failed = await job_status(doomed, job_id)
        finally:
            await doomed.shutdown()
        return job_id, pids, outcomes, failed_within, later_call_failed_within, failed

    job_id, pids, outcomes, failed_within, later_within, failed = run(doomed_job())
    assert all(isinstance(o, JobFailedError) and f"training job {job_id}" in str(o) for o in outcomes), outcomes
    assert failed_within < 10 and later_within < 1
    assert failed["state"] == "FAILED" and "died" in failed["error"]
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
    assert not alive  # the surviving rank, stuck in an all-reduce with a dead peer, was killed too

    async def new_job():
        fresh = create_arctic_rl_client(config)
        try:
            assert fresh.training_job_id != job_id
            result = await fresh.fwd_bwd(sft_batch(), SFT)
            step = await fresh.step()
            old = await job_status(fresh, job_id)
        finally:
            await fresh.shutdown()
        return result, step, old

    result, step, old = run(new_job())
    assert result["loss"] > 0 and step["step"] == 1
    assert old["state"] == "DESTROYED"


@pytest.fixture(scope="module")
def heavier_model(tmp_path_factory) -> str:
    """Wide MLPs (a ~150 MB checkpoint with Adam state), so a save lasts long enough to be killed in the middle."""
    spec = TinySpec(family="qwen2", num_layers=4, intermediate_size=8192)
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "heavier-qwen2", spec))


def checksum(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_whole_and_a_new_job_resumes_identical_weights(
    client, heavier_model, tmp_path
):
    root = tmp_path / "checkpoints"
    probe = sft_batch(rows=3, length=10, seed=5)

    def fields(**extra):
        config = remote_config(client, training_gpus=1, training_config=CPU_TRAINING, **extra)
        return config.model_copy(update={"model_name": heavier_model})

    async def crash_during_second_save():
        trained = create_arctic_rl_client(fields())
        try:
            await trained.fwd_bwd(sft_batch(), SFT)
            await trained.step()
            saved = await trained.save_checkpoint(path=str(root))
            norm = (await trained.weight_norm())["training_norm"]
            log_probs = (await trained.fwd_no_grad(probe, reference_model=False))["log_probs_shifted"]
            first = checksum(root / "global_step1")
            await trained.fwd_bwd(sft_batch(seed=1), SFT)
            await trained.step()
            pid = (await job_status(trained, trained.training_job_id))["pids"][0]
            save = asyncio.ensure_future(trained.save_checkpoint(path=str(root)))

            async def staging():
                return next(root.glob(".tmp-global_step2-*"), None)

            staged = await until(staging, interval=0.002)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(JobFailedError, match="died"):
                await save
        finally:
            await trained.shutdown()
        return saved, norm, log_probs, first, staged

    saved, norm, log_probs, first, staged = run(crash_during_second_save())
    assert saved == {"path": str(root / "global_step1"), "step": 1}
    # Killed mid-write: the staging directory is left over, nothing was renamed, `latest` still names step 1.
    assert staged.exists() and not (root / "global_step2").exists()
    assert (root / "latest").read_text() == "global_step1"
    assert checksum(root / "global_step1") == first

    async def resume():
        resumed = create_arctic_rl_client(fields(checkpoint_path=str(root)))
        try:
            resumed_norm = (await resumed.weight_norm())["training_norm"]
            resumed_log_probs = (await resumed.fwd_no_grad(probe, reference_model=False))["log_probs_shifted"]
            await resumed.fwd_bwd(sft_batch(seed=1), SFT)
            step = await resumed.step()
        finally:
            await resumed.shutdown()
        return resumed_norm, resumed_log_probs, step

    resumed_norm, resumed_log_probs, step = run(resume())
    assert resumed_norm == norm
    assert torch.equal(resumed_log_probs, log_probs)  # every parameter enters the forward: a checksum of the model
    assert step["step"] == 2
