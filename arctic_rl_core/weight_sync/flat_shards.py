"""How an ``fsdp`` training rank holds its part of a parameter: a ZeRO-3 flat partition.

The parameter is flattened, zero-padded to a multiple of the world size and
cut into equal parts; rank r holds part r. This is DeepSpeed ZeRO-3's
layout, so a DeepSpeed rank passes ``FlatShard(param.ds_tensor, param.ds_shape)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


def partition_numel(numel: int, world_size: int) -> int:
    """Elements per rank: ceil(numel / world_size)."""
    return -(-numel // world_size)


@dataclass(frozen=True)
class FlatShard:
    """This rank's 1-D partition of a parameter whose full shape is ``shape``."""

    partition: torch.Tensor
    shape: tuple[int, ...]

    def __init__(self, partition: torch.Tensor, shape: Sequence[int]) -> None:
        object.__setattr__(self, "partition", partition)
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def flat_partition(full: torch.Tensor, rank: int, world_size: int) -> FlatShard:
    """Rank ``rank``'s ZeRO-3 partition of ``full`` (a copy, padded with zeros)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    size = partition_numel(full.numel(), world_size)
    flat = full.detach().reshape(-1)
    part = torch.zeros(size, dtype=full.dtype, device=full.device)
    start = min(rank * size, flat.numel())
    stop = min(start + size, flat.numel())
    part[: stop - start].copy_(flat[start:stop])
    return FlatShard(part, full.shape)
