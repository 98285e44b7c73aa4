"""The Ray server: a named async actor over a JobManager, serving the same op table as HTTP.

Clients call ``call(op_name, request)``; the actor validates the request with
the op's model and dispatches it. Ray's own serialization carries tensors, and
Ray's cluster authentication guards access (see README, Security).
"""

from __future__ import annotations

import logging

import ray

from arctic_rl_core.ops import OPS
from arctic_rl_core.server.manager import DEFAULT_ALLOWED_LOSS_PREFIXES, JobManager
from arctic_rl_core.server.ray_cluster import cluster_device


class ArcticRLRayServer:
    def __init__(self, allowed_loss_prefixes: tuple[str, ...] = DEFAULT_ALLOWED_LOSS_PREFIXES):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.manager = JobManager(cluster_device(), allowed_loss_prefixes)

    async def health(self) -> dict:
        return {"status": "ok"}

    async def call(self, op_name: str, request: dict):
        op = OPS.get(op_name)
        if op is None:
            raise ValueError(f"unknown operation {op_name!r}; known: {sorted(OPS)}")
        return await self.manager.dispatch(op, op.request.model_validate(request))

    async def stop(self) -> None:
        await self.manager.destroy_all()


RemoteRayServer = ray.remote(num_cpus=0, max_concurrency=1000)(ArcticRLRayServer)
