"""Flattened byte buckets: many named tensors in one contiguous buffer, one transfer (or IPC handle) each.

A bucket is a ``uint8`` tensor of at most ``bucket_size`` bytes (a single
tensor larger than that gets a bucket of its own). Its ``BucketLayout`` says
where each tensor lives: name, dtype, shape and byte offset. Tensors of
different dtypes share a bucket; every offset is ``ALIGNMENT``-aligned so each
slot can be viewed as its dtype in place. Layouts follow the input order, so
every process that plans from the same list of (name, dtype, shape) gets the
same buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

# view(dtype) needs offsets divisible by the element size; 256 also keeps
# every slot aligned for vectorized copy kernels and NCCL.
ALIGNMENT = 256


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives inside a bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class BucketLayout:
    """The slots of one bucket, in order, and the bucket's size in bytes."""

    slots: tuple[TensorSlot, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


TensorSpec = tuple[str, torch.dtype, Sequence[int]]


def aligned(offset: int) -> int:
    """``offset`` rounded up to a multiple of ``ALIGNMENT``."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


def plan_buckets(specs: Iterable[TensorSpec], bucket_size: int) -> list[BucketLayout]:
    """Group tensors, in order, into buckets of at most ``bucket_size`` bytes."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 byte, got {bucket_size}")
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    end = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        offset = aligned(end)
        if current and offset + nbytes > bucket_size:
            groups.append(current)
            current, offset = [], 0
        current.append((name, dtype, shape))
        end = offset + nbytes
    if current:
        groups.append(current)
    return [single_bucket(group) for group in groups]


def single_bucket(specs: Iterable[TensorSpec]) -> BucketLayout:
    """All of ``specs`` in one bucket, whatever its size."""
    slots: list[TensorSlot] = []
    end = 0
    for name, dtype, shape in specs:
        slot = TensorSlot(name, dtype, tuple(int(d) for d in shape), aligned(end))
        slots.append(slot)
        end = slot.offset + slot.nbytes
    return BucketLayout(tuple(slots), end)


def plan_tensor_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_size: int) -> list[BucketLayout]:
    """``plan_buckets`` for tensors at hand."""
    return plan_buckets(((name, t.dtype, t.shape) for name, t in named_tensors), bucket_size)


def empty_bucket(layout: BucketLayout, device: torch.device | str) -> torch.Tensor:
    return torch.empty(layout.nbytes, dtype=torch.uint8, device=device)


def slot_view(data: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """The tensor in ``slot``, as a view of the bucket's bytes (no copy)."""
    return data[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


@torch.no_grad()  # parameters require grad; a bucket is plain bytes (torch refuses to share graph nodes over IPC)
def pack_bucket(layout: BucketLayout, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` (in slot order) into ``out``, a ``uint8`` buffer of ``layout.nbytes``; return ``out``."""
    if len(tensors) != len(layout.slots):
        raise ValueError(f"bucket has {len(layout.slots)} slots, got {len(tensors)} tensors")
    if out.dtype != torch.uint8 or out.numel() != layout.nbytes:
        raise ValueError(f"bucket buffer must be uint8 of {layout.nbytes} bytes, got {out.dtype} of {out.numel()}")
    for slot, tensor in zip(layout.slots, tensors):
        if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(
                f"{slot.name}: expected {slot.dtype} {list(slot.shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )
        slot_view(out, slot).copy_(tensor)
    return out


def unpack_bucket(layout: BucketLayout, data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view) for every slot; the views share ``data``'s storage."""
    if data.dtype != torch.uint8 or data.numel() != layout.nbytes:
        raise ValueError(f"bucket must be uint8 of {layout.nbytes} bytes, got {data.dtype} of {data.numel()}")
    return [(slot.name, slot_view(data, slot)) for slot in layout.slots]
