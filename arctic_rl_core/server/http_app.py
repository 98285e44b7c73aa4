"""The HTTP server: one FastAPI route per op in the table, over a JobManager.

Bodies are arctic wire format (``wire.py``) or JSON; responses follow the
client's Accept header. Every route but ``/health`` needs the bearer token.
Errors are JSON ``{"error": type, "detail": message}`` with the status of the
exception (``errors.status_of``); a validation error names the field.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Receive, Scope, Send

from arctic_rl_core import wire
from arctic_rl_core.errors import BadRequest, PayloadTooLarge, Unauthorized, status_of, validation_message
from arctic_rl_core.ops import OPS, Op
from arctic_rl_core.server.manager import JobManager

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 2 * 1024**3
OPEN_PATHS = {"/health"}


class _JSONResponse(JSONResponse):
    """JSON that carries non-finite floats (a diverged loss is a result, not a server error), as Python writes them."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode("utf-8")


def error_response(exc: BaseException) -> JSONResponse:
    if isinstance(exc, ValidationError):
        return JSONResponse({"error": "ValidationError", "detail": validation_message(exc)}, status_code=422)
    status = status_of(exc)
    if status >= 500:
        logger.exception("request failed", exc_info=exc)
    return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=status)


class _BearerAuth:
    """Refuses HTTP requests without the bearer token, except to ``OPEN_PATHS``.

    Plain ASGI rather than ``@app.middleware``: that one runs a task per body
    chunk received, which costs more than the chunk's copy on a big tensor.
    """

    def __init__(self, app: ASGIApp, token: str):
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                refusal = error_response(Unauthorized("missing or wrong bearer token (Authorization: Bearer <token>)"))
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(manager: JobManager, auth_token: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        # Graceful shutdown (SIGTERM included): in-flight requests have finished; release every job.
        await manager.destroy_all()

    app = FastAPI(
        title="arctic-rl",
        version="0.1.0",
        description="RL compute engine: training, sampling, log-prob.",
        lifespan=lifespan,
    )
    app.state.manager = manager

    if auth_token is not None:
        app.add_middleware(_BearerAuth, token=auth_token)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    for op in OPS.values():
        _add_route(app, manager, op, max_body_bytes)
    _install_openapi(app)
    return app


def _add_route(app: FastAPI, manager: JobManager, op: Op, max_body_bytes: int) -> None:
    async def handle(request: Request) -> Response:
        try:
            parsed = _validate(op, await _read(request, op, max_body_bytes))
            result = await manager.dispatch(op, parsed)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status + message
            return error_response(exc)
        return _respond(request, result)

    handle.__name__ = op.name
    extra: dict[str, Any] = {"x-arctic-op": op.name}
    if op.http_method == "GET":
        extra["parameters"] = _parameters(op)
    else:
        schema = {"$ref": f"#/components/schemas/{op.request.__name__}"}
        extra["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": schema},
                wire.CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    app.add_api_route(op.path, handle, methods=[op.http_method], summary=op.doc, name=op.name, openapi_extra=extra)


def _parameters(op: Op) -> list[dict]:
    """A GET op's fields as OpenAPI path or query parameters (the route takes the raw request, so FastAPI cannot)."""
    properties = op.request.model_json_schema()["properties"]
    parameters = []
    for name, field in op.request.model_fields.items():
        in_path = "{" + name + "}" in op.path
        parameters.append(
            {"name": name, "in": "path" if in_path else "query", "required": in_path or field.is_required(),
             "schema": properties[name]}
        )  # fmt: skip
    return parameters


def _validate(op: Op, data: Any) -> Any:
    """The op's request model from the decoded body; whatever a validator trips over is still the caller's input."""
    try:
        return op.request.model_validate(data)
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. torch refusing a nested list of dicts inside a tensor field
        raise BadRequest(f"{op.name}: the request does not validate ({type(exc).__name__}: {exc})") from None


async def _read(request: Request, op: Op, max_body_bytes: int) -> Any:
    if op.http_method == "GET":
        data: dict[str, Any] = dict(request.query_params)
        data.update(request.path_params)
        return data
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {max_body_bytes}")
    # Received once, into one buffer the wire decoder then uses in place.
    body = wire.Body(declared)
    async for chunk in request.stream():
        if body.size + len(chunk) > max_body_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_body_bytes} bytes")
        body.add(chunk)
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if content_type not in (wire.CONTENT_TYPE, "application/json", ""):
        raise ValueError(f"unsupported content-type {content_type!r}; use application/json or {wire.CONTENT_TYPE}")
    try:
        if content_type == wire.CONTENT_TYPE:
            return wire.decode(body.data)
        return json.loads(bytes(body.data)) if body.size else {}
    except Exception as exc:  # noqa: BLE001 - malformed bytes (truncated, nested past the parser) are a bad request
        raise BadRequest(f"request body is not valid {content_type or 'application/json'}: {exc}") from None


def _respond(request: Request, result: Any) -> Response:
    if wire.CONTENT_TYPE in request.headers.get("accept", ""):
        chunks = wire.encode_chunks({"result": result})
        length = sum(memoryview(c).nbytes for c in chunks)
        # Streamed from the result tensors' memory: no copy of the payload on the way out.
        return StreamingResponse(
            _aiter(wire.pieces(chunks)), media_type=wire.CONTENT_TYPE, headers={"content-length": str(length)}
        )
    return _JSONResponse({"result": wire.to_jsonable(result)})


async def _aiter(chunks):
    for chunk in chunks:
        yield chunk


def _install_openapi(app: FastAPI) -> None:
    """Put each op's request model into components.schemas, so POST bodies are documented (and fuzzable)."""
    base_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = base_openapi()
        models = [(op.request, "validation") for op in OPS.values()]
        _, definitions = models_json_schema(models, ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
