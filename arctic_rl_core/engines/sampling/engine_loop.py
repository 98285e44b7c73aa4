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
        return self.submit_all([prompt_token_ids], params)[0]

    def submit_all(self, prompts: list[list[int]], params) -> list[Future]:
        """Completions of each prompt, as futures; all of them run, or (one prompt refused) none does.

        A refused prompt fails every future with its error, naming its index:
        the others are not generated only to be thrown away with the call.
        """
        futures: list[Future] = [Future() for _ in prompts]
        self._inbox.put(("request", (prompts, params, futures)))
        return futures

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
                self._add(*item)

    def _add(self, prompts: list[list[int]], params, futures: list[Future]) -> None:
        added = {}
        for index, prompt in enumerate(prompts):
            request_id = uuid.uuid4().hex
            try:
                self.engine.add_request(prompt, params, request_id)
            except Exception as exc:  # noqa: BLE001 - a bad request fails only its caller
                for added_id in added:
                    self.engine.abort_request(added_id)
                if added:
                    self._step()  # aborts take effect at a step: leave nothing in flight (sleep() refuses that)
                if len(prompts) > 1 and type(exc) is ValueError:  # a prompt's own fault: say which
                    exc = ValueError(f"prompt {index} of {len(prompts)}: {exc}")
                for future in futures:
                    future.set_exception(exc)
                return
            added[request_id] = futures[index]
        self._pending.update(added)

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
