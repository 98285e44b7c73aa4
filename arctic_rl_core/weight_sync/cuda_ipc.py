"""CUDA-IPC weight sync between two processes on one GPU: one IPC handle per flattened bucket.

Opening an IPC handle costs a driver call and a mapping, so one handle per
parameter costs far more than a few large buckets (``benchmarks/weight_sync.py``
measures by how much: its per-parameter row). The sender packs its weights into buckets (``buckets.py``) and
shares each bucket's storage; the receiver opens a bucket, copies the views
out (its ``load`` callable, e.g. a sampler's ``load_weights``), waits for the
copies to finish and drops the mapping, and only then may the sender free it.

Two schedules over the same primitives:
- normal: the sender shares every bucket, the receiver loads them all, then
  the sender releases them (peak: one extra copy of the weights);
- ``low_memory``: share bucket i, load it, release it, then bucket i+1 (peak:
  one bucket).

``CudaIpcSender`` / ``load_shared_buckets`` are the primitives a caller
drives over its own channel (Ray calls, for instance);
``send_over_connection`` / ``receive_over_connection`` drive them over a
``multiprocessing`` connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.multiprocessing.reductions import reduce_tensor

from arctic_rl_core.weight_sync.buckets import (
    BucketLayout,
    empty_bucket,
    pack_bucket,
    plan_tensor_buckets,
    unpack_bucket,
)
from arctic_rl_core.weight_sync.errors import WeightMismatchError, WeightSyncError
from arctic_rl_core.weight_sync.validation import Shapes, check_shapes, layout_shapes

CPU_REFUSAL = "cuda_ipc=True needs CUDA; use cuda_ipc=False (file path)"

# Position of the device index in the arguments of torch's rebuild_cuda_tensor.
_REBUILD_DEVICE_ARG = 6

Load = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


@dataclass(frozen=True)
class SharedBucket:
    """A picklable handle to one bucket in the sender's GPU memory."""

    index: int
    layout: BucketLayout
    device_uuid: str
    rebuild: Callable[..., torch.Tensor]
    rebuild_args: tuple


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _local_device_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; processes with different CUDA_VISIBLE_DEVICES disagree."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise WeightSyncError(
        "open bucket",
        f"the shared bucket lives on GPU {uuid}, which this process cannot see; "
        "the receiver must run on the same GPU as the sender (check CUDA_VISIBLE_DEVICES)",
    )


class CudaIpcSender:
    """Training side: packs weights into buckets on demand and shares them until released.

    The weights must stay unchanged until every bucket is released.
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_size: int) -> None:
        named = list(weights)
        if not torch.cuda.is_available():
            raise ValueError(f"{CPU_REFUSAL}: no CUDA device in this process")
        devices = {t.device for _, t in named}
        off_gpu = [n for n, t in named if t.device.type != "cuda"]
        if off_gpu:
            raise ValueError(f"{CPU_REFUSAL}: {len(off_gpu)} tensors are not on a GPU, e.g. {off_gpu[0]!r}")
        if len(devices) > 1:
            raise ValueError(f"cuda_ipc=True needs all weights on one GPU, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cuda", torch.cuda.current_device())
        self.layouts = plan_tensor_buckets(named, bucket_size)
        self._tensors = dict(named)
        self._live: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.layouts)

    def share(self, index: int) -> SharedBucket:
        """Pack bucket ``index`` and return its handle; it stays allocated until ``release``."""
        if not 0 <= index < len(self.layouts):
            raise IndexError(f"bucket index must be in [0, {len(self.layouts)}), got {index}")
        layout = self.layouts[index]
        with torch.cuda.device(self.device):
            data = pack_bucket(layout, [self._tensors[n] for n in layout.names], empty_bucket(layout, self.device))
            # reduce_tensor records an event on the current stream; the receiver waits on it before reading.
            rebuild, args = reduce_tensor(data)
        self._live[index] = data
        return SharedBucket(index, layout, _device_uuid(self.device), rebuild, tuple(args))

    def share_all(self) -> list[SharedBucket]:
        return [self.share(i) for i in range(len(self.layouts))]

    def release(self, index: int | None = None) -> None:
        """Free bucket ``index`` once the receiver is done with it; with no index, free them all and end the sync."""
        for i in list(self._live) if index is None else [index]:
            self._live.pop(i, None)
        with torch.cuda.device(self.device):
            # Blocks shared over IPC wait in a limbo list until the receiver drops them.
            torch.cuda.ipc_collect()
            if index is None:
                # A colocated sampler wakes its KV cache next and needs this memory back.
                torch.cuda.empty_cache()


def open_bucket(shared: SharedBucket) -> torch.Tensor:
    """Map a shared bucket into this process (no copy)."""
    args = list(shared.rebuild_args)
    args[_REBUILD_DEVICE_ARG] = _local_device_index(shared.device_uuid)
    return shared.rebuild(*args)


def check_layouts(layouts: Sequence[BucketLayout], expected: Shapes | None) -> None:
    """Refuse a sync whose names or shapes differ from ``expected`` (None: accept any)."""
    shapes = layout_shapes(layouts)
    if expected is not None:
        check_shapes(shapes, expected)


def _bucket_views(buckets: Sequence[SharedBucket], loaded: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    for shared in buckets:
        data = open_bucket(shared)
        yield from unpack_bucket(shared.layout, data)
        # The sender frees this memory once we answer: our copies out of it must have finished.
        torch.cuda.synchronize(data.device)
        del data
        loaded.append(shared.index)


def load_shared_buckets(buckets: Sequence[SharedBucket], load: Load, *, expected: Shapes | None = None) -> None:
    """Receiver side: check the buckets against ``expected``, then ``load`` their tensors bucket by bucket.

    ``load`` gets one iterable of (name, tensor) views into the sender's
    memory and must copy them (``load_weights`` does). When this returns,
    every bucket is closed and may be released by the sender.
    """
    if not torch.cuda.is_available():
        raise ValueError(f"{CPU_REFUSAL}: no CUDA device in the receiving process")
    check_layouts([b.layout for b in buckets], expected)
    loaded: list[int] = []
    load(_bucket_views(buckets, loaded))
    if len(loaded) != len(buckets):
        raise WeightSyncError(
            "load",
            f"load() stopped early: it consumed {len(loaded)} of {len(buckets)} buckets; it must read every tensor",
        )


def _expect(conn: Connection, timeout_s: float, step: str, *kinds: str) -> tuple:
    try:
        ready = conn.poll(timeout_s)
        message = conn.recv() if ready else None
    except (EOFError, OSError) as e:
        raise WeightSyncError(step, f"the peer closed the connection ({e!r})") from e
    if message is None:
        raise WeightSyncError(step, f"no answer from the peer within {timeout_s} s")
    if message[0] == "refused":
        raise WeightMismatchError(step, message[1])
    if message[0] == "failed":
        raise WeightSyncError(step, f"the peer failed: {message[1]}")
    if message[0] not in kinds:
        raise WeightSyncError(step, f"expected one of {kinds}, got {message[0]!r}")
    return message


def send_over_connection(
    conn: Connection,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_size: int,
    low_memory: bool = False,
    timeout_s: float = 300.0,
) -> None:
    """Sender side of a CUDA-IPC sync to a process that runs ``receive_over_connection``."""
    sender = CudaIpcSender(weights, bucket_size)
    conn.send(("layouts", sender.layouts))
    _expect(conn, timeout_s, "validate", "accepted")
    try:
        if low_memory:
            for i in range(len(sender)):
                conn.send(("buckets", [sender.share(i)]))
                _expect(conn, timeout_s, f"load bucket {i + 1}/{len(sender)}", "loaded")
                sender.release(i)
        else:
            conn.send(("buckets", sender.share_all()))
            _expect(conn, timeout_s, f"load {len(sender)} buckets", "loaded")
    finally:
        sender.release()
    conn.send(("done",))


def receive_over_connection(
    conn: Connection, load: Load, *, expected: Shapes | None = None, timeout_s: float = 300.0
) -> None:
    """Receiver side of ``send_over_connection``: validate, then load every bucket as it arrives."""
    _, layouts = _expect(conn, timeout_s, "receive layouts", "layouts")
    try:
        check_layouts(layouts, expected)
    except WeightMismatchError as e:
        conn.send(("refused", e.detail))
        raise
    conn.send(("accepted",))
    while True:
        message = _expect(conn, timeout_s, "receive buckets", "buckets", "done")
        if message[0] == "done":
            return
        try:
            load_shared_buckets(message[1], load)
        except Exception as e:
            conn.send(("failed", repr(e)))
            raise
        conn.send(("loaded",))
