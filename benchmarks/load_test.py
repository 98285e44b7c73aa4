"""Many clients on one server: generate throughput and /health latency under load, against one client alone.

    python benchmarks/load_test.py [--clients 8] [--calls 100] [--max-tokens 4] [--model PATH]

Starts a local HTTP deployment (one native sampling replica; a tiny model made here unless --model), then runs the
same number of generate calls twice: from one client, one call after another (the baseline), and from --clients
clients at once (each through its own reconnect config, as a framework's rollout workers would). Prints calls/s of
both and their ratio (what the engine loop's batching of concurrent calls buys), and the p50/p99/max latency of
/health polled from another thread during the concurrent run (the server stays responsive under load).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client
from tests.conftest import free_port


def health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            started = time.perf_counter()
            assert http.get(url).status_code == 200
            out.append(time.perf_counter() - started)
            time.sleep(0.02)


async def calls(client, name: str, count: int, max_tokens: int) -> None:
    for i in range(count):
        result = await client.generate([f"{name} call {i}:"], {"max_tokens": max_tokens, "ignore_eos": True})
        assert len(result[0]["outputs"][0]["token_ids"]) == max_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--calls", type=int, default=100, help="generate calls per client")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--model", default=None, help="model path (default: a tiny qwen2 built here)")
    args = parser.parse_args()

    model = args.model
    if model is None:
        from arctic_rl_core.models.tiny import TinySpec, build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-qwen2", TinySpec(family="qwen2")))
    port = free_port()
    config = ArcticRLClientConfig(
        model_name=model, comm_protocol="http", host="127.0.0.1", port=port, sampling_gpus=1,
        sampling_engine="native", ray_auto_attach=False, server_logs=False,
    )  # fmt: skip
    owner = create_arctic_rl_client(config)
    try:
        total = args.clients * args.calls
        asyncio.run(calls(owner, "warm-up", 10, args.max_tokens))

        started = time.perf_counter()
        asyncio.run(calls(owner, "alone", total, args.max_tokens))
        alone = total / (time.perf_counter() - started)

        clients = [create_arctic_rl_client(owner.reconnect_config()) for _ in range(args.clients)]
        stop, latencies = threading.Event(), []
        probe = threading.Thread(target=health_latencies, args=(f"http://127.0.0.1:{port}/health", stop, latencies))
        probe.start()

        async def together() -> None:
            await asyncio.gather(*(calls(c, f"client {k}", args.calls, args.max_tokens) for k, c in enumerate(clients)))

        started = time.perf_counter()
        asyncio.run(together())
        concurrent = total / (time.perf_counter() - started)
        stop.set()
        probe.join()
        served = asyncio.run(owner.status())["served"]["generate"]
    finally:
        asyncio.run(owner.shutdown())

    assert served == 10 + 2 * total, f"the server counted {served} generate calls, the clients sent {10 + 2 * total}"
    latencies.sort()
    print(f"generate, max_tokens={args.max_tokens}, {total} calls each way")
    print(f"  {'1 client, in turn':<22}: {alone:8.1f} calls/s  (baseline)")
    print(f"  {f'{args.clients} clients at once':<22}: {concurrent:8.1f} calls/s  ratio {concurrent / alone:.2f}x")
    print(
        f"  {'/health during load':<22}: p50 {1e3 * statistics.median(latencies):.1f} ms, "
        f"p99 {1e3 * latencies[int(0.99 * (len(latencies) - 1))]:.1f} ms, max {1e3 * latencies[-1]:.1f} ms "
        f"({len(latencies)} polls)"
    )


if __name__ == "__main__":
    main()
