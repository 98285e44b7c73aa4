"""``actor_rollout_ref.rollout.name=arctic``, inside verl's worker: weight updates become arctic's ``sync_weights``.

verl's synchronous trainer updates the rollout weights through the worker
(``ActorRolloutRefWorker.update_weights``): it resumes the rollout's weights,
streams the engine's tensors into ``update_weights``, then resumes the KV
cache. With arctic-rl both models live in arctic's jobs, so the engine hands
over no tensors and ``update_weights`` asks arctic-rl to copy its training
weights into its sampler, then tells the rollout servers which training step
the sampler now holds (verl tags every trajectory with it).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from verl.workers.rollout.base import BaseRollout

from arctic_rl_verl.session import ArcticSession

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "arctic"


def server_name(replica_rank: int) -> str:
    """The Ray name of a replica's rollout server, in verl's job namespace."""
    return f"arctic_rl_rollout_server_{replica_rank}"


class ArcticRollout(BaseRollout):
    """verl's handle on the arctic sampler from the actor's worker process (one replica: rank 0)."""

    replica_rank = 0

    async def resume(self, tags: list[str]):
        """Wake what ``release`` (or a replica's ``sleep``) freed, when the sampler shares GPUs with training."""
        session = ArcticSession.current()
        if session.sleeps_inference:
            await session.arun(session.client.wake_inference(tags=tags))

    async def release(self):
        session = ArcticSession.current()
        if session.sleeps_inference:
            await session.arun(session.client.sleep_inference(level=1))

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs: Any):
        """Copy arctic's training weights into its sampler; ``weights`` is the engine's empty stream."""
        for name, _ in weights:
            raise RuntimeError(f"the arctic rollout got tensor {name!r} from verl; its weights stay inside arctic-rl")
        session = ArcticSession.current()
        result = await session.arun(session.client.sync_weights(cuda_ipc=False))
        logger.info("arctic-rl sync_weights: %s", {k: v for k, v in result.items() if k != "replicas"})
        global_steps = kwargs.get("global_steps")
        if global_steps is not None:
            server = ray.get_actor(server_name(self.replica_rank))
            await server.set_global_steps.remote(global_steps)
