"""Ray transport: calls on the named server actor; Ray serializes tensors natively."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from arctic_rl_core.client.base import ArcticRLClient, Transport
from arctic_rl_core.errors import ArcticRLError
from arctic_rl_core.ops import Op


def _unwrapped(exc: RayTaskError) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class RayTransport(Transport):
    def __init__(self, actor_name: str, namespace: str):
        self.actor_name, self.namespace = actor_name, namespace
        self._actor = None

    @property
    def actor(self):
        if self._actor is None:
            try:
                self._actor = ray.get_actor(self.actor_name, namespace=self.namespace)
            except ValueError:
                raise ArcticRLError(
                    f"no arctic-rl Ray server named {self.actor_name!r} in namespace {self.namespace!r}"
                ) from None
        return self._actor

    async def call(self, op: Op, request) -> Any:
        try:
            return await self.actor.call.remote(op.name, request.model_dump())
        except RayTaskError as exc:
            raise _unwrapped(exc) from None
        except RayActorError as exc:
            raise ArcticRLError(f"{op.name}: the arctic-rl Ray server died: {exc}") from None

    def call_sync(self, op: Op, request) -> Any:
        try:
            return ray.get(self.actor.call.remote(op.name, request.model_dump()))
        except RayTaskError as exc:
            raise _unwrapped(exc) from None

    def wait_until_healthy(self, timeout: float, interval: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ray.get(self.actor.health.remote(), timeout=max(interval, 1.0))
                return
            except (ArcticRLError, ray.exceptions.GetTimeoutError, RayActorError):
                self._actor = None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Ray server {self.actor_name!r} not healthy after {timeout}s") from None
                time.sleep(interval)


class ArcticRLRayClient(ArcticRLClient):
    """Talks to the server actor over Ray (``comm_protocol="ray"``); usable from inside other Ray actors."""

    def reconnect_config(self):
        config = super().reconnect_config()
        return config.model_copy(update={"comm_protocol": "ray", "host": None, "port": None})
