"""``create_arctic_rl_client``: pick the client for the protocol, start a local server if asked, create jobs."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from arctic_rl_core.client.base import ArcticRLClient
from arctic_rl_core.client.http import ArcticRLHTTPClient, HTTPTransport
from arctic_rl_core.client.ray import ArcticRLRayClient, RayTransport
from arctic_rl_core.config import ArcticRLClientConfig
from arctic_rl_core.errors import ArcticRLError
from arctic_rl_core.server.ray_cluster import connect

logger = logging.getLogger(__name__)

TOKEN_ENV = "ARCTIC_RL_AUTH_TOKEN"
DEFAULT_RAY_SERVER_NAME = "arctic-rl-server"


def create_arctic_rl_client(config: ArcticRLClientConfig) -> ArcticRLClient:
    """A client for ``config``: HTTP or Ray; starts a local server unless reconnecting or remote.

    Jobs are created and awaited here (up to ``job_ready_timeout``), so the
    returned client is ready to use. With job ids in the config it attaches
    to those jobs instead and sends no /initialize.
    """
    if not isinstance(config, ArcticRLClientConfig):
        raise TypeError(f"config must be an ArcticRLClientConfig, got {type(config).__name__}")
    starts_server = config.backend == "local" and not config.reconnecting
    if config.comm_protocol == "http":
        client = _http_client(config, starts_server)
    else:
        client = _ray_client(config, starts_server)
    if not config.reconnecting:
        try:
            client._initialize()
        except BaseException:
            _stop_quietly(client)
            raise
    return client


def _http_client(config: ArcticRLClientConfig, starts_server: bool) -> ArcticRLHTTPClient:
    token = config.auth_token
    server = None
    if starts_server:
        token = token or secrets.token_urlsafe(32)
        config = config.model_copy(update={"auth_token": token})
        server = LocalHTTPServer(config)
    elif token is None:
        token = os.environ.get(TOKEN_ENV)
    transport = HTTPTransport(f"http://{_url_host(config.host)}:{config.port}", token)
    if server is not None:
        try:
            transport.wait_until_healthy(config.startup_timeout, config.health_check_interval, server.alive)
        except ArcticRLError as exc:
            server.kill()
            raise ArcticRLError(f"{exc}\n{server.log_tail()}") from None
        except BaseException:
            server.kill()
            raise
    return ArcticRLHTTPClient(config, transport, server)


def _ray_client(config: ArcticRLClientConfig, starts_server: bool) -> ArcticRLRayClient:
    import ray

    if not ray.is_initialized():
        connect(config.ray_auto_attach, config.ray_namespace, _cpu_gpus(config), log_to_driver=config.server_logs)
    server = None
    if starts_server:
        name = config.ray_server_name or f"{DEFAULT_RAY_SERVER_NAME}-{uuid.uuid4().hex[:8]}"
        config = config.model_copy(update={"ray_server_name": name})
        server = LocalRayServer(config)
    transport = RayTransport(config.ray_server_name or DEFAULT_RAY_SERVER_NAME, config.ray_namespace)
    try:
        transport.wait_until_healthy(config.startup_timeout, config.health_check_interval)
    except BaseException:
        if server is not None:
            server.kill()  # detached: nothing else would ever stop the actor we just created
        raise
    return ArcticRLRayClient(config, transport, server)


def _cpu_gpus(config: ArcticRLClientConfig) -> int:
    """GPU stand-ins to declare when Ray starts without CUDA: enough for this config, at least 8."""
    counts = [config.training_gpus, config.sampling_gpus, config.log_prob_gpus]
    return max(8, sum(counts))


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _stop_quietly(client: ArcticRLClient) -> None:
    """Undo a failed start: stop the server this client started (its jobs go with it), else destroy our jobs."""
    server = client._server
    if server is not None:
        server.kill()
        return
    # A server someone else runs outlives us: the jobs we created there would hold their GPUs with no owner.
    for kind, job_id in client._job_ids.items():
        if job_id is None:
            continue
        try:
            client._call_server_sync("destroy_job", job_id=job_id)
        except Exception as exc:  # noqa: BLE001 - the start's own error is the one to raise
            logger.warning("could not destroy %s job %d after a failed start: %s", kind, job_id, exc)


class LocalHTTPServer:
    """``arctic-rl serve`` as a subprocess of this client, with this client's token."""

    def __init__(self, config: ArcticRLClientConfig):
        _check_port_free(config.host, config.port)
        command = [
            sys.executable, "-m", "arctic_rl_core.server", "serve",
            "--host", config.host, "--port", str(config.port),
            "--cpu-gpus", str(_cpu_gpus(config)), "--exit-with-parent", str(os.getpid()),
        ]  # fmt: skip
        if not config.ray_auto_attach:
            command.append("--no-ray-auto-attach")
        env = {**os.environ, TOKEN_ENV: config.auth_token}
        # Without server_logs the output still goes somewhere: a file whose tail explains a failed start.
        self.log_path = None
        output = None
        if not config.server_logs:
            handle, self.log_path = tempfile.mkstemp(prefix="arctic-rl-server-", suffix=".log")
            output = os.fdopen(handle, "wb")
        logger.info("starting arctic-rl server: %s", " ".join(command))
        self.process = subprocess.Popen(command, env=env, stdout=output, stderr=output, start_new_session=True)
        if output is not None:
            output.close()

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None:
            return "(server output went to this terminal)"
        text = Path(self.log_path).read_text(errors="replace").splitlines()
        return f"last lines of {self.log_path}:\n" + "\n".join(text[-lines:])

    async def stop(self, client: ArcticRLClient) -> None:
        if self.alive():
            try:
                await client._call_server("stop_server")
            except (ArcticRLError, ValueError, OSError) as exc:
                logger.warning("stop_server failed (%s); terminating the server process", exc)
                self.process.terminate()
        try:
            await asyncio.to_thread(self.process.wait, 60)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class LocalRayServer:
    """The Ray server actor, named so other processes and actors can reach it (``reconnect_config``)."""

    def __init__(self, config: ArcticRLClientConfig):
        from arctic_rl_core.server.ray_server import RemoteRayServer

        self.actor = RemoteRayServer.options(
            name=config.ray_server_name, namespace=config.ray_namespace, lifetime="detached"
        ).remote()

    async def stop(self, client: ArcticRLClient) -> None:
        try:
            await self.actor.stop.remote()
        finally:
            self.kill()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # As uvicorn binds: connections of a previous server in TIME_WAIT do not block the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ArcticRLError(
                f"cannot start a local server on {host}:{port} ({exc.strerror}); set port= to a free port, "
                "or set training_job_id/... to reconnect to the server already there"
            ) from None
