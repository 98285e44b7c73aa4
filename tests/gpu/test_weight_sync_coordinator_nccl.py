"""The WeightSyncCoordinator over NCCL between two GPUs: the same code path as the gloo tests, on CUDA."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from arctic_rl_core.config import WeightSyncConfig
from arctic_rl_core.weight_sync import TrainingRank, TransferSchedule, WeightSyncCoordinator, WeightSyncError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights() -> dict[str, torch.Tensor]:
    # 40 MB, in buckets of 16 MB: larger than NCCL's staging buffers, so a send cannot finish without its receive.
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16384, 1024, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(4096, 1024, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(1024, generator=g),
    }


def _member(rank: int, config: WeightSyncConfig, stall: bool, results) -> None:
    torch.cuda.set_device(rank)
    member = TransferSchedule.from_config(config).member(rank)
    weights = {n: t.cuda() for n, t in _weights().items()}
    coordinator = WeightSyncCoordinator(config, member, device="cuda")
    start = time.monotonic()
    try:
        if isinstance(member, TrainingRank):
            coordinator.send(weights.items())
            results.put((rank, None, time.monotonic() - start))
            return
        stream = coordinator.receive({n: t.shape for n, t in weights.items()})
        if stall:
            time.sleep(config.timeout_s + 5)
            results.put((rank, None, 0.0))
            return
        received = {n: t.clone() for n, t in stream}
        exact = all(torch.equal(received[n], weights[n]) for n in weights)
        results.put((rank, None if exact else "values differ", time.monotonic() - start))
    except WeightSyncError as e:
        results.put((rank, e.step, time.monotonic() - start))


def _run(config: WeightSyncConfig, stall: bool) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, config, stall, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, problem, elapsed = results.get(timeout=config.timeout_s * 4 + 60)
        out[rank] = (problem, elapsed)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


def test_nccl_coordinator_moves_weights_bit_exact():
    out = _run(WeightSyncConfig(base_port=_free_port(), bucket_size=16 << 20, timeout_s=60), stall=False)
    assert out[0][0] is None and out[1][0] is None, out


def test_nccl_sender_raises_naming_the_bucket_when_the_receiver_stalls():
    timeout_s = 5.0
    out = _run(WeightSyncConfig(base_port=_free_port(), bucket_size=16 << 20, timeout_s=timeout_s), stall=True)
    step, elapsed = out[0]
    assert step is not None and step.startswith("send bucket"), out
    assert elapsed < timeout_s * 2 + 5
