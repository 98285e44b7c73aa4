"""HTTP transport: httpx, arctic wire format both ways, bearer token, errors mapped back to exceptions."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from typing import Any

import httpcore
import httpx

from arctic_rl_core import wire
from arctic_rl_core.client.base import ArcticRLClient, Transport
from arctic_rl_core.errors import ArcticRLError, JobFailedError, JobNotReady, Unauthorized
from arctic_rl_core.ops import Op

# httpcore reads a response body 64 KB at a time, and each read costs more in h11 and anyio than its bytes cost
# to copy: a 64 MB tensor took ~1000 such trips and half the client's time. A read takes what the socket has
# ready, so a larger bound only means fewer trips. Process-wide: httpcore has no per-client knob for it.
httpcore.AsyncHTTP11Connection.READ_NUM_BYTES = httpcore.HTTP11Connection.READ_NUM_BYTES = 1 << 20


class ArcticRLRequestError(ValueError):
    """The server refused the request (4xx); the message names the problem."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


def raise_for_response(response: httpx.Response, op_name: str) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
        detail, error = body.get("detail", response.text), body.get("error")
    except ValueError:
        detail, error = response.text, None
    status = response.status_code
    if status == 401:
        raise Unauthorized(f"{op_name}: {detail}")
    if status == 409:
        # Both job states answer 409; the body's type tells them apart, as the Ray transport's exceptions do.
        raise (JobNotReady if error == JobNotReady.__name__ else JobFailedError)(f"{op_name}: {detail}")
    if status < 500:
        raise ArcticRLRequestError(status, f"{op_name}: {detail}")
    raise ArcticRLError(f"{op_name}: HTTP {status}: {detail}")


class HTTPTransport(Transport):
    def __init__(self, base_url: str, auth_token: str | None, timeout: float | None = None):
        self.base_url = base_url
        self.headers = {"accept": wire.CONTENT_TYPE}
        if auth_token:
            self.headers["authorization"] = f"Bearer {auth_token}"
        # Long ops (a big fwd_bwd, a long rollout) legitimately take minutes: no read timeout by default.
        self.timeout = httpx.Timeout(timeout, connect=30.0)
        # One pooled AsyncClient per event loop: users may call asyncio.run() more than once.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )

    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout)
            self._clients[loop] = client
        return client

    @staticmethod
    def _encode(op: Op, request, asynchronous: bool) -> dict[str, Any]:
        if op.http_method == "GET":
            return {"params": request.model_dump(exclude_none=True, exclude={"job_id"}), "url": _url(op, request)}
        chunks = wire.encode_chunks(request.model_dump())
        length = sum(memoryview(c).nbytes for c in chunks)
        # Tensor bytes go to the socket from the tensors' memory, in pieces small enough to copy cheaply where
        # h11 and asyncio insist on copying.
        pieces = list(wire.pieces(chunks))
        return {
            "content": _async_chunks(pieces) if asynchronous else pieces,
            "headers": {"content-type": wire.CONTENT_TYPE, "content-length": str(length)},
            "url": op.path,
        }

    @staticmethod
    def _result(op: Op, response: httpx.Response, body: bytearray | memoryview) -> Any:
        if response.status_code >= 400:
            response._content = bytes(body)
            raise_for_response(response, op.name)
        if response.headers.get("content-type", "").startswith(wire.CONTENT_TYPE):
            return wire.decode(body)["result"]
        return json.loads(bytes(body))["result"]

    def _unreachable(self, op: Op, exc: httpx.TransportError) -> ConnectionError:
        # A ConnectionError, as over Ray: callers (shutdown() among them) need not know httpx.
        return ConnectionError(f"{op.name}: no answer from the arctic-rl server at {self.base_url} ({exc!r})")

    async def call(self, op: Op, request) -> Any:
        kwargs = self._encode(op, request, asynchronous=True)
        try:
            async with self._async_client().stream(op.http_method, **kwargs) as response:
                body = wire.Body(response.headers.get("content-length"))
                async for chunk in response.aiter_raw():
                    body.add(chunk)
        except httpx.TransportError as exc:
            raise self._unreachable(op, exc) from None
        return self._result(op, response, body.data)

    def call_sync(self, op: Op, request) -> Any:
        kwargs = self._encode(op, request, asynchronous=False)
        try:
            with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=self.timeout) as client:
                with client.stream(op.http_method, **kwargs) as response:
                    body = wire.Body(response.headers.get("content-length"))
                    for chunk in response.iter_raw():
                        body.add(chunk)
        except httpx.TransportError as exc:
            raise self._unreachable(op, exc) from None
        return self._result(op, response, body.data)

    def health(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_until_healthy(self, timeout: float, interval: float, alive=lambda: True) -> None:
        deadline = time.monotonic() + timeout
        while not self.health():
            if not alive():
                raise ArcticRLError(f"the arctic-rl server at {self.base_url} exited during startup (see its logs)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no healthy arctic-rl server at {self.base_url} after startup_timeout={timeout}s")
            time.sleep(interval)

    async def close(self) -> None:
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()


async def _async_chunks(chunks: list):
    for chunk in chunks:
        yield chunk


def _url(op: Op, request) -> str:
    return op.path.format(**request.model_dump())


class ArcticRLHTTPClient(ArcticRLClient):
    """Talks to the server over HTTP (``comm_protocol="http"``)."""
