"""Client errors and shutdown: an unreachable server, a job that is not running (HTTP as Ray), the seeds' shutdown order."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn

from arctic_rl_core.client.http import ArcticRLHTTPClient, HTTPTransport
from arctic_rl_core.config import ArcticRLClientConfig
from arctic_rl_core.errors import JobFailedError, JobNotReady
from arctic_rl_core.ops import JobKind
from arctic_rl_core.server.http_app import create_app
from arctic_rl_core.server.jobs import JobState
from arctic_rl_core.server.manager import JobManager
from tests.conftest import free_port


def unreachable_client() -> ArcticRLHTTPClient:
    port = free_port()  # bound once and closed: nothing listens there
    config = ArcticRLClientConfig(
        model_name="m", host="127.0.0.1", port=port, training_job_id=0, sampling_job_id=1, log_prob_job_id=2
    )
    return ArcticRLHTTPClient(config, HTTPTransport(f"http://127.0.0.1:{port}", None))


def test_a_call_to_an_unreachable_http_server_raises_connection_error_naming_the_op_and_the_url():
    client = unreachable_client()
    with pytest.raises(
        ConnectionError, match=rf"step: no answer from the arctic-rl server at http://127.0.0.1:{client.config.port}"
    ):
        asyncio.run(client.step())


def test_shutdown_with_the_server_gone_still_resets_every_job_id():
    client = unreachable_client()
    asyncio.run(client.shutdown())
    for name in ("training_job_id", "sampling_job_id", "log_prob_job_id"):
        with pytest.raises(ValueError, match="no .* job"):
            getattr(client, name)


@pytest.fixture
def served_manager():
    """A real HTTP server in a thread over a JobManager; the test registers its jobs."""
    manager = JobManager("cpu")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(manager, None), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield manager, port
    server.should_exit = True
    thread.join(30)


def test_shutdown_destroys_the_training_sampling_and_log_prob_jobs_in_that_order(served_manager):
    manager, port = served_manager
    config = ArcticRLClientConfig(
        model_name="m", sampling_gpus=1, log_prob_gpus=1, training_gpus=1, log_prob_engine="deepspeed"
    )
    destroyed = []
    ids = {}
    for kind in (JobKind.SAMPLING, JobKind.LOG_PROB, JobKind.TRAINING):  # created in the server's order
        job = manager._builder(kind, config, "cpu")(len(manager.jobs), [], None)
        job.state = JobState.RUNNING
        job.on_release = lambda kind=kind: destroyed.append(kind.value)
        manager.jobs[job.job_id], manager._locks[job.job_id] = job, asyncio.Lock()
        ids[kind.id_field] = job.job_id
    client = ArcticRLHTTPClient(
        config.model_copy(update={"host": "127.0.0.1", "port": port, **ids}),
        HTTPTransport(f"http://127.0.0.1:{port}", None),
    )
    asyncio.run(client.shutdown())
    assert destroyed == ["training", "sampling", "log_prob"]
    assert all(job.state is JobState.DESTROYED for job in manager.jobs.values())


def test_a_call_to_a_job_that_is_not_running_raises_job_not_ready_over_http_as_over_ray(served_manager):
    manager, port = served_manager
    config = ArcticRLClientConfig(model_name="m", training_gpus=1, sampling_gpus=0, log_prob_gpus=0)
    job = manager._builder(JobKind.TRAINING, config, "cpu")(0, [], None)  # PENDING: its workers never started
    manager.jobs[0], manager._locks[0] = job, asyncio.Lock()
    client = ArcticRLHTTPClient(
        config.model_copy(update={"host": "127.0.0.1", "port": port, "training_job_id": 0}),
        HTTPTransport(f"http://127.0.0.1:{port}", None),
    )
    with pytest.raises(JobNotReady, match="training job 0 is PENDING"):
        asyncio.run(client.step())
    job.state = JobState.FAILED
    with pytest.raises(JobFailedError):
        asyncio.run(client.step())
