"""One asyncio loop in a daemon thread, so TRL's synchronous training loop can await the arctic client.

The client's methods are coroutines, and its HTTP transport keeps one
connection pool per event loop. A long-lived loop of our own keeps that pool,
and works the same when the caller's thread already runs a loop (notebooks).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopThread:
    def __init__(self, name: str = "arctic-rl-trl"):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and return its result (or raise its exception) here."""
        if self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("the arctic client's event loop is closed (the trainer was shut down)")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
