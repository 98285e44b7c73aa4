"""The client: one method per op in the table, over a transport (HTTP or Ray).

Methods are generated from ``ops.OPS``: the signature is the request model's
payload fields, the docstring is the op's, and the routing fields are filled
from the job ids this client holds. So ``client.fwd_bwd(batch, processing)``
is ``POST /fwd-bwd`` on HTTP and ``call("fwd_bwd", ...)`` on Ray, and both
validate with ``FwdBwdRequest`` before anything is sent.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Optional

from pydantic import ValidationError

from arctic_rl_core.config import ArcticRLClientConfig
from arctic_rl_core.errors import ArcticRLError, JobFailedError, validation_message
from arctic_rl_core.ops import OPS, JobKind, Op

logger = logging.getLogger(__name__)


class Transport:
    """Moves one validated request to the server and its result back."""

    async def call(self, op: Op, request) -> Any:
        raise NotImplementedError

    def call_sync(self, op: Op, request) -> Any:
        """Blocking call, for construction-time work (initialize, readiness polls) outside an event loop."""
        raise NotImplementedError

    def wait_until_healthy(self, timeout: float, interval: float) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class ArcticRLClient:
    """Common to ArcticRLHTTPClient and ArcticRLRayClient; built by ``create_arctic_rl_client``."""

    def __init__(self, config: ArcticRLClientConfig, transport: Transport, server=None):
        self.config = config
        self._transport = transport
        self._server = server  # the local server this client started, if any
        self._job_ids: dict[str, Optional[int]] = {
            "training": config.training_job_id,
            "sampling": config.sampling_job_id,
            "log_prob": config.log_prob_job_id,
        }

    # ------------------------------------------------------------ job ids

    def _job_id(self, kind: str) -> int:
        job_id = self._job_ids[kind]
        if job_id is None:
            raise ValueError(f"no {kind} job: it was not initialized ({kind}_gpus=0) or was shut down")
        return job_id

    @property
    def training_job_id(self) -> int:
        return self._job_id("training")

    @property
    def sampling_job_id(self) -> int:
        return self._job_id("sampling")

    @property
    def log_prob_job_id(self) -> int:
        return self._job_id("log_prob")

    # ------------------------------------------------------------ setup

    def _initialize(self) -> None:
        """Create the config's jobs on the server and wait until each is RUNNING."""
        ids = self._call_server_sync("initialize", config=self.config.for_initialize())
        for kind in JobKind:
            self._job_ids[kind.value] = ids.get(kind.id_field)
        self._wait_for_jobs()
        self.publish_reconnect_config()

    def publish_reconnect_config(self) -> None:
        """Export this client's reconnect config to child processes (``ArcticRLClientConfig.reconnect_config()``)."""
        import os

        from arctic_rl_core.config import RECONNECT_ENV

        os.environ[RECONNECT_ENV] = self.reconnect_config().model_dump_json()

    def _wait_for_jobs(self) -> None:
        interval = min(self.config.health_check_interval, 0.5)
        for kind, job_id in self._job_ids.items():
            if job_id is None:
                continue
            deadline = time.monotonic() + self.config.job_ready_timeout
            while True:
                status = self._call_server_sync("job_status", job_id=job_id)
                if status["state"] == "RUNNING":
                    break
                if status["state"] in ("FAILED", "DESTROYED"):
                    raise JobFailedError(f"{kind} job {job_id} is {status['state']}: {status.get('error')}")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{kind} job {job_id} not RUNNING after job_ready_timeout={self.config.job_ready_timeout}s "
                        f"(state {status['state']})"
                    )
                time.sleep(interval)

    def _request(self, op: Op, arguments: dict) -> Any:
        data = dict(arguments)
        for field in op.routing_fields:
            data[field] = self._job_ids[field.removesuffix("_job_id")]
        try:
            return op.request.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"{op.name}: {validation_message(exc)}") from None

    def _call_server_sync(self, name: str, **arguments) -> Any:
        op = OPS[name]
        return self._transport.call_sync(op, self._request(op, arguments))

    async def _call_server(self, name: str, **arguments) -> Any:
        op = OPS[name]
        return await self._transport.call(op, self._request(op, arguments))

    # ------------------------------------------------------------ lifecycle

    def reconnect_config(self) -> ArcticRLClientConfig:
        """A config that attaches to this client's jobs from another process or Ray actor (no /initialize)."""
        return self.config.model_copy(
            update={
                "backend": "local",
                "training_job_id": self._job_ids["training"],
                "sampling_job_id": self._job_ids["sampling"],
                "log_prob_job_id": self._job_ids["log_prob"],
                "auth_token": self.config.auth_token,
            }
        )

    async def status(self) -> dict:
        """Server and job states."""
        return await self._call_server("status")

    async def shutdown(self) -> None:
        """Destroy the training, sampling and log-prob jobs, in that order; stop the server this client started."""
        errors = []
        for kind in ("training", "sampling", "log_prob"):
            job_id = self._job_ids[kind]
            if job_id is None:
                continue
            try:
                await self._call_server("destroy_job", job_id=job_id)
            except (ArcticRLError, ValueError, ConnectionError) as exc:
                errors.append(f"{kind} job {job_id}: {exc}")
            self._job_ids[kind] = None
        if self._server is not None:
            await self._server.stop(self)
            self._server = None
        await self._transport.close()
        if errors:
            logger.warning("shutdown: %s", "; ".join(errors))


def _op_method(op: Op):
    """A client coroutine method for ``op`` whose signature is the op's payload fields."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name in op.payload_fields:
        field = op.request.model_fields[name]
        default = inspect.Parameter.empty if field.is_required() else field.get_default(call_default_factory=True)
        parameters.append(
            inspect.Parameter(
                name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=field.annotation
            )
        )
    signature = inspect.Signature(parameters)

    async def method(self: ArcticRLClient, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{op.name}{signature}: {exc}") from None
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        if op.client_defaults is not None:
            arguments = op.client_defaults(self.config, arguments)
        for field in op.routing_fields:
            if op.request.model_fields[field].is_required():
                self._job_id(field.removesuffix("_job_id"))  # a clear ValueError when the job does not exist
        return await self._transport.call(op, self._request(op, arguments))

    method.__name__ = method.__qualname__ = op.name
    method.__doc__ = op.doc
    method.__signature__ = signature
    return method


for _op in OPS.values():
    if not _op.server:
        setattr(ArcticRLClient, _op.name, _op_method(_op))
