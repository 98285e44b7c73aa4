"""HTTP transport: httpx, arctic wire format both ways, bearer token, errors mapped back to exceptions."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from typing import Any

import httpx

from arctic_rl_core import wire
from arctic_rl_core.client.base import ArcticRLClient, Transport
from arctic_rl_core.errors import ArcticRLError, JobFailedError, Unauthorized
from arctic_rl_core.ops import Op


class ArcticRLRequestError(ValueError):
    """The server refused the request (4xx); the message names the problem."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


def raise_for_response(response: httpx.Response, op_name: str) -> None:
    if response.status_code < 400:
        return
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    status = response.status_code
    if status == 401:
        raise Unauthorized(f"{op_name}: {detail}")
    if status == 409:
        raise JobFailedError(f"{op_name}: {detail}")
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
        # Tensor bytes go to the socket straight from the tensors' memory: no copy on this side.
        return {
            "content": _async_chunks(chunks) if asynchronous else chunks,
            "headers": {"content-type": wire.CONTENT_TYPE, "content-length": str(length)},
            "url": op.path,
        }

    @staticmethod
    def _result(op: Op, response: httpx.Response, body: bytearray) -> Any:
        if response.status_code >= 400:
            response._content = bytes(body)
            raise_for_response(response, op.name)
        if response.headers.get("content-type", "").startswith(wire.CONTENT_TYPE):
            return wire.decode(body)["result"]
        return json.loads(body)["result"]

    async def call(self, op: Op, request) -> Any:
        kwargs = self._encode(op, request, asynchronous=True)
        async with self._async_client().stream(op.http_method, **kwargs) as response:
            body = _Receiver(response)
            async for chunk in response.aiter_raw():
                body.add(chunk)
        return self._result(op, response, body.data)

    def call_sync(self, op: Op, request) -> Any:
        kwargs = self._encode(op, request, asynchronous=False)
        with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=self.timeout) as client:
            with client.stream(op.http_method, **kwargs) as response:
                body = _Receiver(response)
                for chunk in response.iter_raw():
                    body.add(chunk)
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


class _Receiver:
    """Collects a response body into one preallocated bytearray, which ``wire.decode`` then uses in place."""

    def __init__(self, response: httpx.Response):
        declared = response.headers.get("content-length")
        self.data = bytearray(int(declared)) if declared and declared.isdigit() else bytearray()
        self.fixed = bool(self.data)
        self.size = 0

    def add(self, chunk: bytes) -> None:
        end = self.size + len(chunk)
        if self.fixed and end <= len(self.data):
            self.data[self.size : end] = chunk
        else:
            del self.data[self.size :]
            self.data += chunk
            self.fixed = False
        self.size = end


def _url(op: Op, request) -> str:
    return op.path.format(**request.model_dump())


class ArcticRLHTTPClient(ArcticRLClient):
    """Talks to the server over HTTP (``comm_protocol="http"``)."""
