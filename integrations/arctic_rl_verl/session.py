"""The arctic-rl deployment a verl worker process drives: one client, shared by actor, reference and rollout.

The actor engine starts it (``ArcticSession.start``): that creates the arctic
server and its training, sampling and log-prob jobs. The reference engine and
the rollout adapter, built in the same worker process, use it through
``ArcticSession.current()``; the rollout servers verl's trainer launches in
other processes attach to the same jobs with ``reconnect_config()``.

verl calls engines from synchronous methods of an asyncio Ray actor, where no
event loop can be run, so the client lives on a loop of its own in a
background thread; ``run`` and ``arun`` hand coroutines to it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from arctic_rl_core import ArcticRLClient, ArcticRLClientConfig, create_arctic_rl_client

logger = logging.getLogger(__name__)

# At interpreter exit the cluster may already be going away: never wait on it for long.
SHUTDOWN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RolloutHandoff:
    """What a rollout server in another process needs to serve this session's sampler."""

    client_config: ArcticRLClientConfig
    sleeps_inference: bool
    batch_window_s: float


class ArcticSession:
    """A started arctic-rl client and the event loop it runs on."""

    _current: ClassVar[Optional["ArcticSession"]] = None

    def __init__(self, client: ArcticRLClient, batch_window_s: float):
        self.client = client
        # Colocated on GPUs, the sampler frees its memory while verl trains (see ArcticRollout).
        self.sleeps_inference = client.config.colocate and client.config.device == "cuda"
        self.batch_window_s = batch_window_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="arctic-rl-client", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config: ArcticRLClientConfig, batch_window_s: float) -> "ArcticSession":
        """Create the arctic jobs ``config`` asks for and make them this process's session."""
        if cls._current is not None:
            raise RuntimeError(
                "an arctic-rl session is already running in this process; verl builds one actor per worker"
            )
        logger.info("starting arctic-rl: %s", config.model_dump(exclude={"auth_token"}))
        session = cls(create_arctic_rl_client(config), batch_window_s)
        cls._current = session
        atexit.register(session.close)
        return session

    @classmethod
    def current(cls) -> "ArcticSession":
        if cls._current is None:
            raise RuntimeError(
                "no arctic-rl session in this process: the arctic actor engine starts it, and the arctic reference "
                "and rollout run in the actor's worker (actor_rollout_ref.hybrid_engine=true)"
            )
        return cls._current

    def run(self, coroutine: Coroutine, timeout: Optional[float] = None) -> Any:
        """Run a client coroutine to completion from synchronous code."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def arun(self, coroutine: Coroutine) -> Any:
        """Await a client coroutine from another event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    def handoff(self) -> RolloutHandoff:
        return RolloutHandoff(self.client.reconnect_config(), self.sleeps_inference, self.batch_window_s)

    def served(self) -> dict[str, int]:
        """The server's count of calls served, per operation."""
        return dict(self.run(self.client.status())["served"])

    def close(self) -> None:
        """Destroy the jobs and stop the server this session started (also at interpreter exit)."""
        if ArcticSession._current is not self:
            return
        ArcticSession._current = None
        try:
            self.run(self.client.shutdown(), timeout=SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - shutting down: report, never raise from atexit
            logger.warning("arctic-rl shutdown failed: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)


def handoff_of(worker: Any) -> RolloutHandoff:
    """Run inside a verl worker actor (``worker.__ray_call__``): how to attach to its session's sampler."""
    return ArcticSession.current().handoff()
