"""``arctic-rl serve``: a standalone HTTP server for remote clients (``backend="dss-platform"``/``"remote"``).

    arctic-rl serve --host 0.0.0.0 --port 7000 --auth-token "$TOKEN"
    ARCTIC_RL_AUTH_TOKEN=... arctic-rl serve
    arctic-rl serve --insecure            # loopback only, no token

The local backend of the client starts the same server as a subprocess.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys

from arctic_rl_core.config import primary_ip
from arctic_rl_core.server.http_app import DEFAULT_MAX_BODY_BYTES, create_app
from arctic_rl_core.server.manager import DEFAULT_ALLOWED_LOSS_PREFIXES, JobManager
from arctic_rl_core.server.ray_cluster import DEFAULT_NAMESPACE, connect

TOKEN_ENV = "ARCTIC_RL_AUTH_TOKEN"
logger = logging.getLogger("arctic_rl_core.server")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arctic-rl", description="arctic-rl: RL compute engine server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start an HTTP server")
    serve.add_argument("--host", default=None, help="bind address (default: this node's primary IP)")
    serve.add_argument("--port", type=int, default=7000)
    serve.add_argument("--auth-token", default=None, help=f"bearer token (or set {TOKEN_ENV})")
    serve.add_argument("--insecure", action="store_true", help="no token; only allowed on a loopback address")
    serve.add_argument(
        "--allow-loss-prefix",
        action="append",
        default=[],
        help="module prefix whose functions may be named as loss_fn by dotted path (repeatable)",
    )
    serve.add_argument("--no-ray-auto-attach", action="store_true", help="always start a fresh Ray cluster")
    serve.add_argument("--cpu-gpus", type=int, default=8, help="GPU stand-ins to declare when there is no CUDA")
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--exit-with-parent", type=int, default=None, metavar="PID", help=argparse.SUPPRESS)
    return parser


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = args.host or primary_ip()
    token = args.auth_token or os.environ.get(TOKEN_ENV)
    if token is None and not args.insecure:
        print(f"arctic-rl serve: pass --auth-token (or set {TOKEN_ENV}), or --insecure on loopback", file=sys.stderr)
        return 2
    if token is None and not _is_loopback(host):
        print(f"arctic-rl serve: --insecure is allowed only on a loopback address, not {host}", file=sys.stderr)
        return 2
    device = connect(not args.no_ray_auto_attach, DEFAULT_NAMESPACE, args.cpu_gpus)
    prefixes = DEFAULT_ALLOWED_LOSS_PREFIXES + tuple(args.allow_loss_prefix)
    server: uvicorn.Server | None = None

    def stop() -> None:
        server.should_exit = True

    manager = JobManager(device, prefixes, on_stop=stop)
    app = create_app(manager, token, args.max_body_bytes)
    # uvloop and httptools, in C: per body chunk they cost a fraction of asyncio and h11, which a 64 MB tensor
    # crosses in hundreds of chunks. (server.run() builds the loop config names; asyncio.run() would not.)
    config = uvicorn.Config(
        app, host=host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=30,
        loop="uvloop", http="httptools",
    )  # fmt: skip
    server = uvicorn.Server(config)
    if args.exit_with_parent is not None:
        _exit_with_parent(args.exit_with_parent, stop)
    logger.info("arctic-rl serving on http://%s:%d (device %s)", host, args.port, device)
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown (the app's lifespan destroys the jobs), then raises the
    # signal again under the handler it found. That would be Ray's driver handler, which exits with the signal's
    # number before Ray is shut down; this one lets the shutdown below run and the process exit 0.
    for handled in (signal.SIGTERM, signal.SIGINT):
        signal.signal(handled, _shutdown_done)
    server.run()
    import ray

    ray.shutdown()
    return 0


def _shutdown_done(signum: int, _frame) -> None:
    logger.info("%s served: in-flight requests finished and jobs destroyed", signal.Signals(signum).name)


def _exit_with_parent(pid: int, stop) -> None:
    """A local backend's server must not outlive the client process that started it."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(1.0)
        logger.warning("parent process %d is gone; shutting down", pid)
        stop()

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        sys.exit(serve(args))


if __name__ == "__main__":
    main()
