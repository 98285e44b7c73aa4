"""Real deployments for end-to-end tests: a server, Ray, DeepSpeed and a sampler, all on CPU.

One deployment per protocol is shared by the whole session (start-up is the
slow part); tests that must create, break or destroy jobs do it on the same
server through a second client (``remote_client``), never on the shared jobs.
"""

from __future__ import annotations

import asyncio

import pytest

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client
from tests.conftest import free_port

CPU_TRAINING = {"dtype": "float32", "optimizer": {"lr": 1e-3}}


def deployment_config(model: str, protocol: str, **overrides) -> ArcticRLClientConfig:
    fields = dict(
        model_name=model,
        comm_protocol=protocol,
        training_gpus=1,
        sampling_gpus=1,
        log_prob_gpus=1,
        log_prob_engine="deepspeed",
        training_config=CPU_TRAINING,
        ray_auto_attach=False,
        startup_timeout=300,
        job_ready_timeout=600,
        server_logs=False,
    )
    if protocol == "http":
        fields.update(host="127.0.0.1", port=free_port())
    fields.update(overrides)
    return ArcticRLClientConfig(**fields)


@pytest.fixture(scope="session", params=["http", "ray"])
def client(request, tiny_model):
    """A running deployment (training + sampling + DeepSpeed log-prob), shared by the session."""
    client = create_arctic_rl_client(deployment_config(tiny_model, request.param))
    yield client
    asyncio.run(client.shutdown())


def run(coro):
    return asyncio.run(coro)
