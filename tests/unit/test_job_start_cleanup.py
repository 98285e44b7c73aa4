"""Starting jobs that cannot start: nothing stays reserved, and no job is left without an owner.

Real Ray (CPU "GPUs"), a real JobManager and a real Ray server actor; the model name is never loaded.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray
from ray.util import placement_group_table
from ray.util.placement_group import placement_group, remove_placement_group

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client
from arctic_rl_core.errors import BadRequest, JobFailedError
from arctic_rl_core.server.manager import JobManager
from arctic_rl_core.server.ray_cluster import connect
from arctic_rl_core.server.ray_server import RemoteRayServer

pytestmark = pytest.mark.slow

NAMESPACE = "arctic-rl-review"
GPUS = 4


@pytest.fixture(scope="module")
def device():
    """The session's Ray if one runs (its deployments stay up: counts below are relative), else our own."""
    started = not ray.is_initialized()
    yield connect(False, NAMESPACE, cpu_gpus=GPUS, log_to_driver=False)
    if started:
        ray.shutdown()


def config(**fields) -> ArcticRLClientConfig:
    return ArcticRLClientConfig(model_name="/no/such/model", comm_protocol="ray", **fields)


def live_groups() -> int:
    return sum(1 for group in placement_group_table().values() if group["state"] != "REMOVED")


def test_initialize_with_a_bad_training_config_names_the_field_and_reserves_nothing(device):
    before = live_groups()
    manager = JobManager(device)
    bad = config(sampling_gpus=1, training_gpus=1, training_config={"dtype": "fp8"})
    with pytest.raises(BadRequest, match=r"training_config\.dtype: Input should be 'float32', 'bfloat16'"):
        asyncio.run(manager.initialize(bad))
    assert manager.jobs == {}
    assert live_groups() == before


def test_float16_on_cpu_workers_is_refused_naming_the_field_and_reserves_nothing(device):
    before = live_groups()
    manager = JobManager(device)
    fp16 = config(training_gpus=1, device="cpu", training_config={"dtype": "float16"})
    with pytest.raises(BadRequest, match=r"training_config\.dtype: 'float16' needs CUDA"):
        asyncio.run(manager.initialize(fp16))
    assert manager.jobs == {} and live_groups() == before


def test_initialize_that_cannot_place_every_job_releases_the_groups_it_did_reserve(device):
    before = live_groups()
    # Another deployment's group leaves 2 GPUs free: room for sampling's 1, not for training's 2 after it.
    taken = int(ray.available_resources().get("GPU", 0)) - 2
    other = placement_group([{"GPU": 1}] * taken) if taken > 0 else None
    if other is not None:
        ray.get(other.ready())
    try:
        manager = JobManager(device)
        too_big = config(sampling_gpus=1, training_gpus=2, job_ready_timeout=2.0)
        with pytest.raises(BadRequest, match="could not reserve 2 GPU bundles"):
            asyncio.run(manager.initialize(too_big))
        assert live_groups() == before + (other is not None), "the sampling job's group was left reserved"
    finally:
        if other is not None:
            remove_placement_group(other)


def test_a_job_destroyed_before_its_start_ran_never_creates_workers(device):
    before = live_groups()

    async def scenario():
        manager = JobManager(device)
        ids = await manager.initialize(config(training_gpus=1))
        job = manager.jobs[ids["training_job_id"]]
        await manager.destroy_job(job.job_id)  # before the start task had its turn
        await asyncio.wait_for(asyncio.gather(*manager._starts), timeout=20)
        return job

    job = asyncio.run(scenario())
    assert job.state.value == "DESTROYED" and job.workers == []
    assert live_groups() == before


def test_a_client_whose_jobs_do_not_come_up_destroys_them_on_a_server_it_did_not_start(device):
    name = f"review-server-{uuid.uuid4().hex[:8]}"
    server = RemoteRayServer.options(name=name, namespace=NAMESPACE).remote()
    try:
        remote = config(
            backend="remote", ray_server_name=name, ray_namespace=NAMESPACE, training_gpus=1, job_ready_timeout=1.0
        )
        with pytest.raises((TimeoutError, JobFailedError)):
            create_arctic_rl_client(remote)
        jobs = ray.get(server.call.remote("status", {}))["jobs"]
        assert [job["state"] for job in jobs] == ["DESTROYED"]
    finally:
        ray.get(server.stop.remote())
        ray.kill(server)
