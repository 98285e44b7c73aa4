"""One arctic-rl client for a SkyRL run, and the event-loop thread all its calls run on.

SkyRL calls its dispatch synchronously from inside its own running event loop
(``RayPPOTrainer.train`` is a coroutine), and its generator awaits the
inference client on that same loop. The arctic client is async. Running every
client coroutine on one private loop in a background thread serves both: a
dispatch call blocks on the result (as SkyRL's own ``ray.get`` does), a
generator call awaits it, and the client's connections live on a single loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Optional, TypeVar

from arctic_rl_core import ArcticRLClient, ArcticRLClientConfig, create_arctic_rl_client

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ArcticSession:
    """Starts the arctic jobs once (``start``), runs client calls on its loop, and shuts them down (``close``)."""

    def __init__(self) -> None:
        self._client: Optional[ArcticRLClient] = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="arctic-rl-client", daemon=True)
        self._thread.start()

    @property
    def client(self) -> ArcticRLClient:
        if self._client is None:
            raise RuntimeError("the arctic-rl jobs are not started yet: the trainer starts them in build_models()")
        return self._client

    def start(self, config: ArcticRLClientConfig) -> None:
        """Create the arctic jobs of ``config`` (blocks until each is RUNNING)."""
        if self._client is not None:
            raise RuntimeError("this session's arctic-rl jobs are already started")
        # Job creation is synchronous and long; it never touches the session loop.
        self._client = create_arctic_rl_client(config)
        logger.info(
            "arctic-rl jobs ready: training=%s sampling=%s log_prob=%s",
            config.training_gpus, config.sampling_gpus, config.log_prob_gpus,
        )  # fmt: skip

    def call(self, method: Callable[[ArcticRLClient], Awaitable[T]]) -> T:
        """Run ``method(client)`` on the session loop and wait for its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(self._invoke(method), self._loop).result()

    async def acall(self, method: Callable[[ArcticRLClient], Awaitable[T]]) -> T:
        """Like :meth:`call`, awaited from another event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._invoke(method), self._loop))

    async def _invoke(self, method: Callable[[ArcticRLClient], Awaitable[T]]) -> T:
        return await method(self.client)

    def close(self) -> None:
        """Destroy the jobs and stop the server this session started, then the loop thread. Idempotent."""
        try:
            if self._client is not None:
                client, self._client = self._client, None
                asyncio.run_coroutine_threadsafe(client.shutdown(), self._loop).result()
        finally:
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()

    def status(self) -> dict[str, Any]:
        """The arctic server's status: job states and how many calls of each op it served."""
        return self.call(lambda client: client.status())
