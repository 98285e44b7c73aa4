"""One thread that owns a step-wise engine, so concurrent generate calls share its batch.

Callers on any thread ``submit`` a request and wait on a future; the loop
thread adds it at the next ``step()`` and resolves the future when the request
finishes. Everything else that touches the engine (weight loads, sleep, wake)
also runs on the loop thread, through ``call``, between steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from concurrent.futures import Future
from typing import Any, Callable

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine, name: str = "engine-loop"):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, Future] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, prompt_token_ids: list[int], params) -> Future:
        """Completions of one prompt (``params.n`` of them), as a future."""
        future: Future = Future()
        self._inbox.put(("request", (prompt_token_ids, params, future)))
        return future

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the loop thread between steps; return its result (or raise its error)."""
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        return future.result()

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            # Block for work only when the engine is idle; otherwise drain the inbox and step.
            block = not self._pending
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                self._step()
                continue
            if kind == "stop":
                self._fail_all(RuntimeError("the sampling engine loop stopped"))
                return
            if kind == "call":
                fn, future = item
                self._resolve(future, fn, self.engine)
            else:
                prompt, params, future = item
                request_id = uuid.uuid4().hex
                try:
                    self.engine.add_request(prompt, params, request_id)
                except Exception as exc:  # noqa: BLE001 - a bad request fails only its caller
                    future.set_exception(exc)
                    continue
                self._pending[request_id] = future

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the batch's callers, keep serving
            logger.exception("engine step failed")
            self._fail_all(exc)
            return
        for output in outputs:
            future = self._pending.pop(output.request_id, None)
            if future is not None:
                future.set_result(output.completions)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, future in list(self._pending.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - already gone
                pass
            future.set_exception(exc)
        self._pending.clear()

    @staticmethod
    def _resolve(future: Future, fn, *args) -> None:
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            future.set_exception(exc)
