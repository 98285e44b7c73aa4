"""``arctic-rl serve`` starts only with a token, or with ``--insecure`` on a loopback address."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from arctic_rl_core.config import primary_ip
from tests.conftest import free_port

pytestmark = pytest.mark.slow

TOKEN_ENV = "ARCTIC_RL_AUTH_TOKEN"


def serve(*arguments: str, env: dict | None = None) -> subprocess.Popen:
    environment = {key: value for key, value in os.environ.items() if key != TOKEN_ENV}
    return subprocess.Popen(
        [sys.executable, "-m", "arctic_rl_core.server", "serve", "--no-ray-auto-attach", "--cpu-gpus", "1", *arguments],
        env={**environment, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "arguments, reason",
    [
        (("--host", "127.0.0.1"), "pass --auth-token"),
        (("--host", "0.0.0.0", "--insecure"), "only on a loopback address, not 0.0.0.0"),
        (("--host", "::", "--insecure"), "only on a loopback address, not ::"),
        (("--insecure",), "only on a loopback address"),  # the default host is the node's routable IP
    ],
    ids=["no-token", "insecure-on-all-ipv4", "insecure-on-all-ipv6", "insecure-on-the-default-host"],
)
def test_serve_refuses_to_start_without_a_token_unless_insecure_on_loopback(arguments, reason):
    if "--host" not in arguments and ipaddress.ip_address(primary_ip()).is_loopback:
        pytest.skip("this node has no routable address: the default host is loopback here")
    process = serve("--port", str(free_port()), *arguments)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert reason in output
    assert "Started a local Ray instance" not in output  # refused before any cluster starts


def test_serve_insecure_on_loopback_starts_answers_without_a_token_and_exits_0_on_sigterm():
    port = free_port()
    process = serve("--host", "127.0.0.1", "--port", str(port), "--insecure")
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.5)
        status = httpx.get(f"http://127.0.0.1:{port}/status", timeout=10)
        assert status.status_code == 200 and status.json()["result"]["jobs"] == []
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
