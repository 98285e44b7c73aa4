"""Exceptions that cross the client/server boundary, each with one HTTP status.

A client turns 4xx answers back into ``ValueError`` subclasses (the caller
sent something wrong) and job failures into ``JobFailedError``.
"""

from __future__ import annotations

from pydantic import ValidationError


class ArcticRLError(RuntimeError):
    """Base of server-side failures that are not the caller's fault."""

    status = 500


class BadRequest(ValueError):
    """The request is well-formed but cannot be served as asked (names the field and the fix)."""

    status = 400


class NotFound(ValueError):
    status = 404


class Unauthorized(PermissionError):
    status = 401


class JobFailedError(ArcticRLError):
    """The job is FAILED (a worker died or its start failed); the message carries the cause."""

    status = 409


class JobNotReady(ArcticRLError):
    """The job is PENDING or DESTROYED."""

    status = 409


class EngineAsleep(BadRequest):
    """The call needs state that ``sleep_*`` moved off the device: wake the engine first."""


class PayloadTooLarge(ValueError):
    status = 413


def validation_message(exc: ValidationError, prefix: str = "") -> str:
    """'field.path: what is wrong' for each error, without pydantic's URLs; ``prefix`` names the enclosing field."""
    parts = []
    for error in exc.errors():
        location = ".".join(str(p) for p in (prefix, *error["loc"]) if p != "") or "request"
        parts.append(f"{location}: {error['msg']}")
    return "; ".join(parts)


def status_of(exc: BaseException) -> int:
    """HTTP status for an exception raised while serving a request."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    if isinstance(exc, ValueError):
        return 400
    return 500
