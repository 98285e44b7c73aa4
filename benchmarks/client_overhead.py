"""Client/server transport overhead, HTTP vs Ray, measured in one run on loopback.

    python benchmarks/client_overhead.py [--iterations 300] [--megabytes 64]

Prints, per protocol, the p50/p99 latency of a no-op-sized op (``status``) and
the throughput of a tensor round trip (``echo`` of an N MB float32 tensor:
N MB up, N MB down), plus the HTTP/Ray ratios. Targets: HTTP small op p50 <=
3 ms; tensor transport >= 1 GB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from arctic_rl_core.client.http import HTTPTransport  # noqa: E402
from arctic_rl_core.client.ray import RayTransport  # noqa: E402
from arctic_rl_core.ops import OPS, EchoRequest, EmptyRequest  # noqa: E402
from tests.conftest import free_port  # noqa: E402


async def measure(transport, iterations: int, megabytes: int) -> dict:
    status, echo = OPS["status"], OPS["echo"]
    for _ in range(20):  # warm connections and code paths
        await transport.call(status, EmptyRequest())
    latencies = []
    for _ in range(iterations):
        started = time.perf_counter()
        await transport.call(status, EmptyRequest())
        latencies.append(time.perf_counter() - started)
    tensor = torch.randn(megabytes * 1024 * 1024 // 4)
    request = EchoRequest(payload={"t": tensor})
    for _ in range(2):  # first calls size the receive buffers on both sides, as the first steps of a run do
        await transport.call(echo, request)
    rounds, started = 10, time.perf_counter()
    for _ in range(rounds):
        back = await transport.call(echo, request)
    elapsed = time.perf_counter() - started
    assert torch.equal(back["t"], tensor), "echo changed the tensor"
    latencies.sort()
    return {
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
        "round_trip_GBps": 2 * tensor.nbytes * rounds / elapsed / 1e9,
    }


def http_results(iterations: int, megabytes: int) -> dict:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "arctic_rl_core.server", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--insecure", "--no-ray-auto-attach", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        transport = HTTPTransport(f"http://127.0.0.1:{port}", None)
        transport.wait_until_healthy(120, 0.5, alive=lambda: server.poll() is None)
        return asyncio.run(measure(transport, iterations, megabytes))
    finally:
        server.terminate()
        server.wait(60)


def ray_results(iterations: int, megabytes: int) -> dict:
    import ray

    from arctic_rl_core.server.ray_cluster import connect
    from arctic_rl_core.server.ray_server import RemoteRayServer

    connect(auto_attach=False, log_to_driver=False)
    actor = RemoteRayServer.options(name="arctic-rl-bench", namespace="arctic-rl").remote()
    transport = RayTransport("arctic-rl-bench", "arctic-rl")
    transport.wait_until_healthy(60, 0.5)
    try:
        return asyncio.run(measure(transport, iterations, megabytes))
    finally:
        ray.kill(actor)


def memcpy_gbps(megabytes: int) -> float:
    """Bandwidth of one in-process copy of the same bytes: the ceiling every transport copy runs into."""
    tensor = torch.randn(megabytes * 1024 * 1024 // 4)
    out = torch.empty_like(tensor)
    out.copy_(tensor)
    started = time.perf_counter()
    for _ in range(10):
        out.copy_(tensor)
    return 10 * tensor.nbytes / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--megabytes", type=int, default=64)
    args = parser.parse_args()
    results = {
        "http": http_results(args.iterations, args.megabytes),
        "ray": ray_results(args.iterations, args.megabytes),
    }
    copy = memcpy_gbps(args.megabytes)
    print(f"{'protocol':<8} {'small op p50':>13} {'p99':>9} {f'{args.megabytes} MB round trip':>20}")
    for name, r in results.items():
        print(f"{name:<8} {r['p50_ms']:>10.2f} ms {r['p99_ms']:>6.2f} ms {r['round_trip_GBps']:>15.2f} GB/s")
    http, ray_ = results["http"], results["ray"]
    print(f"baseline: in-process copy of {args.megabytes} MB: {copy:.2f} GB/s; round trips reach "
          f"http {results['http']['round_trip_GBps'] / copy:.2f}x, ray {results['ray']['round_trip_GBps'] / copy:.2f}x of it")  # fmt: skip
    print(f"ratio http/ray: small op p50 {http['p50_ms'] / ray_['p50_ms']:.2f}x, "
          f"throughput {http['round_trip_GBps'] / ray_['round_trip_GBps']:.2f}x")  # fmt: skip
    print(f"targets: http p50 <= 3 ms: {'met' if http['p50_ms'] <= 3 else 'MISSED'}; "
          f">= 1 GB/s: http {'met' if http['round_trip_GBps'] >= 1 else 'MISSED'}, "
          f"ray {'met' if ray_['round_trip_GBps'] >= 1 else 'MISSED'}")  # fmt: skip


if __name__ == "__main__":
    main()
