"""CUDA-IPC weight sync between two processes on one GPU: one IPC handle per bucket, never per parameter.

Opening an IPC handle costs a driver call and a mapping, so one handle per
parameter costs far more than a few large buffers (``benchmarks/weight_sync.py``
measures by how much: its per-parameter row). A sync shares a few buffers and
describes where each tensor lives in them (a ``BucketLayout`` per buffer); the
receiver maps a buffer, copies the views out (its ``load`` callable, e.g. a
sampler's ``load_weights``), waits for the copies to finish, and only then may
the sender reuse or free the buffer.

Which buffers:
- in place: when the weights are views of a few large storages (DeepSpeed
  ZeRO-1/2 keeps its 16-bit parameters in one flat buffer per group), those
  storages are shared as they are. Nothing is packed and no memory is added;
- packed: otherwise the weights are copied into flattened buckets of at most
  ``bucket_size`` bytes (``buckets.py``).

Two schedules over the same primitives:
- normal: share every bucket, the receiver loads them all, then release them
  (packed peak: one extra copy of the weights);
- ``low_memory``: share bucket i, load it, release it, then bucket i+1 (packed
  peak: one bucket).

One-shot or in a session. Without one, each sync plans its buckets, exports
their handles, and the receiver maps and unmaps them. With an ``IpcSession``
on the sender and an ``IpcMappings`` on the receiver, the plan, the packed
buckets, the handles, the receiver's mappings, views and validation all
outlive the sync: a repeat sync of the same tensors is the receiver's copies
and one round trip (plus the packing copy where packing is needed). What a
session holds stays allocated until the receiver ``forget``s its mappings and
the sender ``close``s the session; a colocated training engine does both
before it sleeps.

``CudaIpcSender`` / ``load_shared_buckets`` are the primitives a caller
drives over its own channel (Ray calls, for instance);
``send_over_connection`` / ``receive_over_connection`` drive them over a
``multiprocessing`` connection.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.multiprocessing.reductions import reduce_tensor

from arctic_rl_core.weight_sync.buckets import (
    BucketLayout,
    TensorSlot,
    empty_bucket,
    pack_bucket,
    plan_tensor_buckets,
    slot_view,
    unpack_bucket,
)
from arctic_rl_core.weight_sync.errors import WeightMismatchError, WeightSyncError
from arctic_rl_core.weight_sync.validation import Shapes, check_shapes, layout_shapes

CPU_REFUSAL = "cuda_ipc=True needs CUDA; use cuda_ipc=False (file path)"

# Position of the device index in the arguments of torch's rebuild_cuda_tensor.
_REBUILD_DEVICE_ARG = 6

Load = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
Named = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SharedBucket:
    """A picklable handle to one buffer in the sender's GPU memory, and where each tensor lives in it."""

    index: int
    layout: BucketLayout
    device_uuid: str
    rebuild: Callable[..., torch.Tensor]
    rebuild_args: tuple
    # Set when the buffer outlives this sync (a session): receivers may keep it mapped under this id.
    buffer_id: str | None = None
    # Set in a session: the plan this bucket belongs to; receivers key cached views and validation on it.
    generation: str | None = None


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _local_device_index(device_uuid: str) -> int:
    """This process's index of the GPU with ``device_uuid``; processes with different CUDA_VISIBLE_DEVICES disagree."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(torch.device("cuda", index)) == device_uuid:
            return index
    raise WeightSyncError(
        "open bucket",
        f"the shared bucket lives on GPU {device_uuid}, which this process cannot see; "
        "the receiver must run on the same GPU as the sender (check CUDA_VISIBLE_DEVICES)",
    )


# ----------------------------------------------------------------------------- sender


@dataclass
class _Plan:
    """How one set of weights travels: the buckets' layouts and, per bucket, what fills it."""

    layouts: list[BucketLayout]
    tensors: list[list[torch.Tensor]]  # per bucket, in slot order
    storages: list[torch.Tensor] | None  # in place: per bucket, the whole storage as uint8; None: packed
    generation: str = field(default_factory=lambda: uuid.uuid4().hex)
    shared: dict[int, SharedBucket] = field(default_factory=dict)  # session: handles made once
    packed_views: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # session: slots of staged buckets

    @property
    def in_place(self) -> bool:
        return self.storages is not None


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _plan_in_place(named: Named, bucket_size: int) -> _Plan | None:
    """Share the storages the weights already live in, when that takes no more handles than packing would."""
    by_storage: dict[int, Named] = {}
    for name, tensor in named:
        if not tensor.is_contiguous():
            return None
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append((name, tensor))
    packed_buckets = math.ceil(sum(t.nbytes for _, t in named) / bucket_size)
    if not by_storage or len(by_storage) > max(1, packed_buckets):
        return None
    layouts, tensors, storages = [], [], []
    for group in by_storage.values():
        whole = _whole_storage(group[0][1])
        slots = tuple(
            TensorSlot(name, t.dtype, tuple(t.shape), t.storage_offset() * t.element_size()) for name, t in group
        )
        layouts.append(BucketLayout(slots, whole.numel()))
        tensors.append([t for _, t in group])
        storages.append(whole)
    return _Plan(layouts, tensors, storages)


def _plan(named: Named, bucket_size: int) -> _Plan:
    in_place = _plan_in_place(named, bucket_size)
    if in_place is not None:
        return in_place
    by_name = dict(named)
    layouts = plan_tensor_buckets(named, bucket_size)
    return _Plan(layouts, [[by_name[n] for n in layout.names] for layout in layouts], None)


def _allocation_id(rebuild_args: tuple) -> str:
    """Names one shared storage: its allocation's IPC handle and its offset in that allocation."""
    handle, offset = rebuild_args[7], rebuild_args[9]
    return f"{handle.hex() if isinstance(handle, bytes) else handle}@{offset}"


@dataclass
class _StagedBuffer:
    data: torch.Tensor
    rebuild: Callable[..., torch.Tensor]
    rebuild_args: tuple
    buffer_id: str


class IpcSession:
    """Sender-side state kept across syncs: the plan, packed buckets and exported handles.

    The plan is reused while the same tensors (by name, address, dtype and
    shape) are synced with the same settings. Packed buckets live in slots:
    slot ``i`` holds bucket ``i``, or every bucket in turn with ``low_memory``
    (slot 0, sized to the largest bucket).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._key: tuple | None = None
        self._plan: _Plan | None = None
        self._slots: dict[int, _StagedBuffer] = {}
        self._announced: set[str] = set()

    def plan(self, named: Named, bucket_size: int, low_memory: bool) -> _Plan:
        key = (bucket_size, low_memory, tuple((n, t.data_ptr(), t.dtype, tuple(t.shape)) for n, t in named))
        if key != self._key:
            self._key, self._plan = key, _plan(named, bucket_size)
        return self._plan

    def buffer(self, slot: int, nbytes: int) -> _StagedBuffer:
        staged = self._slots.get(slot)
        if staged is None or staged.data.numel() < nbytes:
            with torch.cuda.device(self.device):
                data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                rebuild, args = reduce_tensor(data)
            staged = _StagedBuffer(data, rebuild, tuple(args), uuid.uuid4().hex)
            self._slots[slot] = staged
            if self._plan is not None:
                self._plan.packed_views.clear()  # views of the old buffer
        return staged

    def announced(self, generation: str) -> bool:
        """Whether the receiver has this plan's layouts (validated, views cached)."""
        return generation in self._announced

    def announce(self, generation: str) -> None:
        self._announced.add(generation)

    @property
    def nbytes(self) -> int:
        """GPU memory the session holds of its own (in-place plans add none)."""
        return sum(s.data.numel() for s in self._slots.values())

    def close(self) -> None:
        """Drop everything; receivers must have forgotten their mappings, or the memory stays in use."""
        self._key = self._plan = None
        self._slots.clear()
        self._announced.clear()
        with torch.cuda.device(self.device):
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()


class CudaIpcSender:
    """Training side: shares the weights' buckets on demand until released.

    The weights must stay unchanged until every bucket is released. With a
    ``session``, the plan and the buffers are reused across syncs.
    """

    def __init__(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        bucket_size: int,
        *,
        session: IpcSession | None = None,
        low_memory: bool = False,
    ) -> None:
        named = list(weights)
        if not torch.cuda.is_available():
            raise ValueError(f"{CPU_REFUSAL}: no CUDA device in this process")
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 byte, got {bucket_size}")
        devices = {t.device for _, t in named}
        off_gpu = [n for n, t in named if t.device.type != "cuda"]
        if off_gpu:
            raise ValueError(f"{CPU_REFUSAL}: {len(off_gpu)} tensors are not on a GPU, e.g. {off_gpu[0]!r}")
        if len(devices) > 1:
            raise ValueError(f"cuda_ipc=True needs all weights on one GPU, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cuda", torch.cuda.current_device())
        if session is not None and session.device != self.device:
            raise ValueError(f"the session lives on {session.device}, the weights on {self.device}")
        self.session = session
        self.low_memory = low_memory
        self._plan = session.plan(named, bucket_size, low_memory) if session is not None else _plan(named, bucket_size)
        self._live: dict[int, torch.Tensor] = {}

    @property
    def layouts(self) -> list[BucketLayout]:
        return self._plan.layouts

    @property
    def generation(self) -> str | None:
        return self._plan.generation if self.session is not None else None

    def __len__(self) -> int:
        return len(self._plan.layouts)

    def share(self, index: int) -> SharedBucket:
        """Bucket ``index``, ready to read (packed now if it must be); it stays valid until ``release``."""
        if not 0 <= index < len(self):
            raise IndexError(f"bucket index must be in [0, {len(self)}), got {index}")
        plan = self._plan
        with torch.cuda.device(self.device):
            if plan.in_place:
                # The receiver reads the weights themselves: the step that wrote them must be done.
                torch.cuda.current_stream().synchronize()
                return self._handle(index, plan.storages[index])
            if self.session is None:
                layout = plan.layouts[index]
                data = pack_bucket(layout, plan.tensors[index], empty_bucket(layout, self.device))
                self._live[index] = data  # freed on release, once the receiver has copied out
                # reduce_tensor records an event on this stream; the receiver waits on it before reading.
                return self._handle(index, data)
            staged = self._pack_staged(index)
            # A receiver that kept its mapping waits on no event of ours: the bytes must be there when it reads.
            torch.cuda.current_stream().synchronize()
            return self._handle(index, staged.data, staged)

    def _pack_staged(self, index: int) -> _StagedBuffer:
        plan = self._plan
        largest = max(layout.nbytes for layout in plan.layouts)
        slot, nbytes = (0, largest) if self.low_memory else (index, plan.layouts[index].nbytes)
        staged = self.session.buffer(slot, nbytes)
        views = plan.packed_views.get(index)
        if views is None:
            # Checks dtypes and shapes once per plan; later syncs copy into the same slots.
            pack_bucket(plan.layouts[index], plan.tensors[index], staged.data[: plan.layouts[index].nbytes])
            views = plan.packed_views[index] = [slot_view(staged.data, s) for s in plan.layouts[index].slots]
        else:
            torch._foreach_copy_(views, plan.tensors[index])
        return staged

    def _handle(self, index: int, data: torch.Tensor, staged: _StagedBuffer | None = None) -> SharedBucket:
        plan = self._plan
        cached = plan.shared.get(index) if self.session is not None else None
        if cached is not None and (staged is None or cached.buffer_id == staged.buffer_id):
            return cached
        if staged is not None:
            rebuild, args, buffer_id = staged.rebuild, staged.rebuild_args, staged.buffer_id
        else:
            rebuild, args = reduce_tensor(data)
            args = tuple(args)
            buffer_id = _allocation_id(args) if self.session is not None else None
        shared = SharedBucket(
            index, plan.layouts[index], _device_uuid(self.device), rebuild, args, buffer_id, self.generation
        )
        if self.session is not None:
            plan.shared[index] = shared
        return shared

    def share_all(self) -> list[SharedBucket]:
        return [self.share(i) for i in range(len(self))]

    def release(self, index: int | None = None) -> None:
        """Free bucket ``index`` once the receiver is done with it; with no index, free them all and end the sync."""
        for i in list(self._live) if index is None else [index]:
            self._live.pop(i, None)
        if self.session is not None or self._plan.in_place:
            return  # nothing of ours to free: the session keeps its buffers, in-place buckets are the weights
        with torch.cuda.device(self.device):
            # Blocks shared over IPC wait in a limbo list until the receiver drops them.
            torch.cuda.ipc_collect()
            if index is None:
                # A colocated sampler wakes its KV cache next and needs this memory back.
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- receiver


def open_bucket(shared: SharedBucket) -> torch.Tensor:
    """Map a shared bucket into this process (no copy)."""
    args = list(shared.rebuild_args)
    args[_REBUILD_DEVICE_ARG] = _local_device_index(shared.device_uuid)
    return shared.rebuild(*args)


class IpcMappings:
    """Receiver-side state kept across syncs: mapped buffers, their tensor views, validated plans.

    Only buckets of a session (with a ``buffer_id``) are kept; one-shot
    buckets are unmapped after each sync.
    """

    def __init__(self) -> None:
        self._mapped: dict[str, torch.Tensor] = {}
        self._views: dict[tuple[str, int], list[tuple[str, torch.Tensor]]] = {}
        self._validated: set[str] = set()

    def views(self, shared: SharedBucket) -> list[tuple[str, torch.Tensor]]:
        """(name, view) for every tensor of the bucket; a session's are cached per plan."""
        key = (shared.generation, shared.index)
        if shared.generation is not None and key in self._views:
            return self._views[key]
        if shared.buffer_id is None:
            data = open_bucket(shared)
        else:
            data = self._mapped.get(shared.buffer_id)
            if data is None:
                data = self._mapped[shared.buffer_id] = open_bucket(shared)
        # A low-memory staging buffer is sized to the largest bucket: this bucket is its head.
        views = unpack_bucket(shared.layout, data[: shared.layout.nbytes])
        if shared.generation is not None and shared.buffer_id is not None:
            self._views[key] = views
        return views

    def cached_views(self, generation: str, index: int) -> list[tuple[str, torch.Tensor]] | None:
        return self._views.get((generation, index))

    def validated(self, generation: str | None) -> bool:
        return generation is not None and generation in self._validated

    def mark_validated(self, generation: str | None) -> None:
        if generation is not None:
            self._validated.add(generation)

    def forget(self) -> int:
        """Unmap every kept buffer so the sender can free it; return how many were mapped."""
        count = len(self._mapped)
        self._views.clear()
        self._mapped.clear()
        self._validated.clear()
        return count


def check_layouts(layouts: Sequence[BucketLayout], expected: Shapes | None) -> None:
    """Refuse a sync whose names or shapes differ from ``expected`` (None: accept any)."""
    shapes = layout_shapes(layouts)
    if expected is not None:
        check_shapes(shapes, expected)


def _load_views(
    views_per_bucket: Iterable[list[tuple[str, torch.Tensor]]], load: Load, device: torch.device | None
) -> int:
    """Hand every view to ``load``; return how many buckets it consumed, after its copies finished."""
    loaded = 0

    def views() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal loaded
        for bucket in views_per_bucket:
            yield from bucket
            loaded += 1

    load(views())
    # The sender may reuse or free these buffers once we answer: our copies out of them must have finished.
    torch.cuda.synchronize(device)
    return loaded


def load_shared_buckets(
    buckets: Sequence[SharedBucket],
    load: Load,
    *,
    expected: Shapes | None = None,
    mappings: IpcMappings | None = None,
) -> None:
    """Receiver side: check the buckets against ``expected``, then ``load`` their tensors bucket by bucket.

    ``load`` gets one iterable of (name, tensor) views into the sender's
    memory and must copy them (``load_weights`` does). When this returns,
    every one-shot bucket is closed and may be released by the sender; a
    session's buckets stay mapped in ``mappings`` for the next sync.
    """
    if not torch.cuda.is_available():
        raise ValueError(f"{CPU_REFUSAL}: no CUDA device in the receiving process")
    mappings = mappings if mappings is not None else IpcMappings()
    generations = {b.generation for b in buckets}
    if not all(mappings.validated(g) for g in generations):
        check_layouts([b.layout for b in buckets], expected)
        for generation in generations:
            mappings.mark_validated(generation)
    loaded = _load_views((mappings.views(b) for b in buckets), load, None)
    if loaded != len(buckets):
        raise WeightSyncError(
            "load",
            f"load() stopped early: it consumed {loaded} of {len(buckets)} buckets; it must read every tensor",
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
    session: IpcSession | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Sender side of a CUDA-IPC sync to a process that runs ``receive_over_connection``.

    A repeat sync in a session whose plan the receiver already holds sends
    bucket indices only, not handles and layouts.
    """
    sender = CudaIpcSender(weights, bucket_size, session=session, low_memory=low_memory)
    generation = sender.generation
    known = generation is not None and session.announced(generation)
    if not known:
        conn.send(("layouts", sender.layouts))
        _expect(conn, timeout_s, "validate", "accepted")
    steps = [[i] for i in range(len(sender))] if low_memory else [list(range(len(sender)))]
    try:
        for indices in steps:
            shared = [sender.share(i) for i in indices]
            conn.send(("cached", generation, indices) if known else ("buckets", shared))
            where = f"bucket {indices[0] + 1}/{len(sender)}" if low_memory else f"{len(sender)} buckets"
            _expect(conn, timeout_s, f"load {where}", "loaded")
            if low_memory:
                sender.release(indices[0])
    finally:
        sender.release()
    if generation is not None and not known:
        session.announce(generation)
    conn.send(("done",))


def receive_over_connection(
    conn: Connection,
    load: Load,
    *,
    expected: Shapes | None = None,
    mappings: IpcMappings | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Receiver side of ``send_over_connection``: validate, then load every bucket as it arrives.

    Pass the same ``mappings`` to every call when the sender uses a session.
    """
    mappings = mappings if mappings is not None else IpcMappings()
    while True:
        message = _expect(conn, timeout_s, "receive", "layouts", "buckets", "cached", "done")
        kind = message[0]
        if kind == "done":
            return
        try:
            if kind == "layouts":
                check_layouts(message[1], expected)
                conn.send(("accepted",))
                continue
            if kind == "buckets":
                buckets = message[1]
                mappings.mark_validated(buckets[0].generation)  # its layouts were checked just before
                load_shared_buckets(buckets, load, mappings=mappings)
            else:
                _, generation, indices = message
                views = [mappings.cached_views(generation, i) for i in indices]
                if any(v is None for v in views):
                    raise WeightSyncError("load", f"no mapping kept for plan {generation}: was it forgotten?")
                _load_views(views, load, None)
        except WeightMismatchError as e:
            conn.send(("refused", e.detail))
            raise
        except Exception as e:
            conn.send(("failed", repr(e)))
            raise
        conn.send(("loaded",))
