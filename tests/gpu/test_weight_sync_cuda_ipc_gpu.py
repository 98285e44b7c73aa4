"""CUDA-IPC weight sync between two processes on one GPU (normal and low-memory)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from arctic_rl_core.weight_sync import WeightMismatchError, receive_over_connection, send_over_connection

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKET_SIZE = 4 << 20


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {}
    for layer in range(6):
        weights[f"model.layers.{layer}.mlp.up_proj.weight"] = torch.randn(1024, 512, device="cuda", generator=g).to(
            torch.bfloat16
        )
        weights[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(512, device="cuda", generator=g)
    weights["model.embed_tokens.weight"] = torch.randn(4096, 512, device="cuda", generator=g).to(torch.bfloat16)
    return weights


def _receiver(conn, specs: dict, syncs: int, extra_name: str | None, results) -> None:
    torch.cuda.set_device(0)
    params = {n: torch.zeros(shape, dtype=dtype, device="cuda") for n, (shape, dtype) in specs.items()}
    expected = {n: p.shape for n, p in params.items()}
    if extra_name:
        expected[extra_name] = (1,)

    def load(weights):
        for name, tensor in weights:
            params[name].copy_(tensor)

    try:
        for _ in range(syncs):
            receive_over_connection(conn, load, expected=expected, timeout_s=60)
        results.put({n: p.cpu() for n, p in params.items()})
    except WeightMismatchError as e:
        results.put(str(e))


def _start_receiver(weights: dict, syncs: int, extra_name: str | None = None):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    results = ctx.Queue()
    specs = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
    proc = ctx.Process(target=_receiver, args=(there, specs, syncs, extra_name, results))
    proc.start()
    return proc, here, results


@pytest.mark.parametrize("low_memory", [False, True])
def test_cuda_ipc_sync_is_bit_exact(low_memory):
    weights = _weights()
    proc, conn, results = _start_receiver(weights, syncs=1)
    send_over_connection(conn, weights.items(), bucket_size=BUCKET_SIZE, low_memory=low_memory, timeout_s=60)
    received = results.get(timeout=60)
    proc.join(timeout=60)
    assert received.keys() == weights.keys()
    assert all(torch.equal(received[n], weights[n].cpu()) for n in weights)


def test_low_memory_holds_one_bucket_and_every_sync_returns_its_memory():
    weights = _weights()
    total = sum(t.nbytes for t in weights.values())
    largest = max(t.nbytes for t in weights.values())
    proc, conn, results = _start_receiver(weights, syncs=2)
    peaks = {}
    for low_memory in (False, True):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        send_over_connection(conn, weights.items(), bucket_size=BUCKET_SIZE, low_memory=low_memory, timeout_s=60)
        peaks[low_memory] = torch.cuda.max_memory_allocated() - before
        assert torch.cuda.memory_allocated() == before, "a sync kept GPU memory after release"
    results.get(timeout=60)
    proc.join(timeout=60)
    assert peaks[False] >= total
    assert peaks[True] <= max(BUCKET_SIZE, largest) + (1 << 20)


def test_receiver_refuses_a_mismatch_and_the_sender_raises():
    weights = _weights()
    proc, conn, results = _start_receiver(weights, syncs=1, extra_name="model.extra.weight")
    with pytest.raises(WeightMismatchError, match="missing model.extra.weight"):
        send_over_connection(conn, weights.items(), bucket_size=BUCKET_SIZE, timeout_s=60)
    assert "missing model.extra.weight" in results.get(timeout=60)
    proc.join(timeout=60)
