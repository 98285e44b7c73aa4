"""CUDA-IPC weight sync between two processes on one GPU (normal and low-memory, one-shot and in a session)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.multiprocessing as mp

from arctic_rl_core.weight_sync import (
    IpcMappings,
    IpcSession,
    WeightMismatchError,
    receive_over_connection,
    send_over_connection,
)

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


def _flat(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values as views of one flat buffer per dtype, as DeepSpeed ZeRO-1/2 holds parameters."""
    views = {}
    for dtype in {t.dtype for t in weights.values()}:
        group = {n: t for n, t in weights.items() if t.dtype == dtype}
        buffer = torch.cat([t.flatten() for t in group.values()])
        offset = 0
        for name, tensor in group.items():
            views[name] = buffer[offset : offset + tensor.numel()].view(tensor.shape)
            offset += tensor.numel()
    return views


def _as_bytes(params: dict[str, torch.Tensor]) -> bytes:
    # Plain bytes: a CPU tensor put on a queue is fetched from the child's fd server, gone once it exits.
    buffer = io.BytesIO()
    torch.save({n: p.cpu() for n, p in params.items()}, buffer)
    return buffer.getvalue()


def _received(results) -> dict[str, torch.Tensor]:
    message = results.get(timeout=60)
    return torch.load(io.BytesIO(message)) if isinstance(message, bytes) else message


def _receiver(conn, specs: dict, syncs: int, extra_name: str | None, results, staged: bool = False) -> None:
    torch.cuda.set_device(0)
    params = {n: torch.zeros(shape, dtype=dtype, device="cuda") for n, (shape, dtype) in specs.items()}
    expected = {n: p.shape for n, p in params.items()}
    if extra_name:
        expected[extra_name] = (1,)

    def load(weights):
        for name, tensor in weights:
            params[name].copy_(tensor)

    mappings = IpcMappings() if staged else None
    try:
        for _ in range(syncs):
            receive_over_connection(conn, load, expected=expected, mappings=mappings, timeout_s=60)
            results.put(_as_bytes(params))
        if staged:
            results.put(mappings.forget())
    except WeightMismatchError as e:
        results.put(str(e))


def _start_receiver(weights: dict, syncs: int, extra_name: str | None = None, staged: bool = False):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    results = ctx.Queue()
    specs = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
    proc = ctx.Process(target=_receiver, args=(there, specs, syncs, extra_name, results, staged))
    proc.start()
    return proc, here, results


@pytest.mark.parametrize("low_memory", [False, True])
def test_cuda_ipc_sync_is_bit_exact(low_memory):
    weights = _weights()
    proc, conn, results = _start_receiver(weights, syncs=1)
    send_over_connection(conn, weights.items(), bucket_size=BUCKET_SIZE, low_memory=low_memory, timeout_s=60)
    received = _received(results)
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
        _received(results)
    proc.join(timeout=60)
    assert peaks[False] >= total
    assert peaks[True] <= max(BUCKET_SIZE, largest) + (1 << 20)


def test_receiver_refuses_a_mismatch_and_the_sender_raises():
    weights = _weights()
    proc, conn, results = _start_receiver(weights, syncs=1, extra_name="model.extra.weight")
    with pytest.raises(WeightMismatchError, match="missing model.extra.weight"):
        send_over_connection(conn, weights.items(), bucket_size=BUCKET_SIZE, timeout_s=60)
    assert "missing model.extra.weight" in _received(results)
    proc.join(timeout=60)


@pytest.mark.parametrize("flat", [False, True], ids=["packed", "in-place"])
@pytest.mark.parametrize("low_memory", [False, True])
def test_session_sync_reuses_its_buffers_carries_new_weights_and_frees_on_close(low_memory, flat):
    weights = _flat(_weights()) if flat else _weights()
    total = sum(t.nbytes for t in weights.values())
    proc, conn, results = _start_receiver(weights, syncs=3, staged=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    session = IpcSession(torch.device("cuda", 0))
    for sync in range(3):
        for t in weights.values():
            t.add_(1)  # a training step between syncs: the receiver must see the new values
        send_over_connection(
            conn, weights.items(), bucket_size=BUCKET_SIZE, low_memory=low_memory, session=session, timeout_s=60
        )
        received = _received(results)
        assert all(torch.equal(received[n], weights[n].cpu()) for n in weights), f"sync {sync} is not bit-exact"
        if sync == 0:
            held = session.nbytes
        assert session.nbytes == held, "a later sync allocated new buffers"
    mapped = results.get(timeout=60)  # the receiver kept one mapping per buffer, then forgot them
    if flat:
        assert held == 0, "in-place sharing must not allocate: the weights' own storages are shared"
        assert mapped == 2  # one flat storage per dtype
    elif low_memory:
        assert held <= BUCKET_SIZE + (1 << 20) and mapped == 1
    else:
        assert held >= total and mapped >= 3
    session.close()
    proc.join(timeout=60)
    assert torch.cuda.memory_allocated() == before, "closing the session did not return its memory"
