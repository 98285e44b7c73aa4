"""Where each job's workers run: Ray placement groups, split or colocated.

Split: every job gets its own placement group of one-GPU bundles. Colocated:
one placement group of ``max(gpus)`` bundles is shared, and worker i of every
job lands on bundle i with a fraction of its GPU, so training rank i, sampling
replica i and log-prob rank i share device i. On CPU the "GPUs" are Ray
resources declared at ``ray.init``: the same code path places CPU workers.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from arctic_rl_core.errors import BadRequest


@dataclass
class Slot:
    """One worker's place: a bundle of a placement group and its share of that bundle's GPU."""

    group: PlacementGroup
    bundle: int
    gpu_fraction: float

    def actor_options(self) -> dict:
        return {
            "num_gpus": self.gpu_fraction,
            # Workers take no CPU reservation: on a 2-core box three engines must still fit.
            "num_cpus": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=self.bundle
            ),
        }


class SharedGroup:
    """A placement group several colocated jobs hold; removed when the last one lets go."""

    def __init__(self, group: PlacementGroup, holders: int):
        self.group, self.holders = group, holders

    def release(self) -> None:
        self.holders -= 1
        if self.holders <= 0:
            remove_placement_group(self.group)


def check_capacity(needed: int) -> None:
    available = ray.cluster_resources().get("GPU", 0)
    if needed > available:
        raise BadRequest(
            f"the jobs need {needed} GPUs but the Ray cluster has {available:g}; lower training_gpus/sampling_gpus/"
            "log_prob_gpus, set colocate=True, or add nodes"
        )


def gpus_needed(counts: list[int], colocate: bool) -> int:
    return max(counts) if colocate else sum(counts)


async def reserve(bundles: int, timeout: float) -> PlacementGroup:
    group = placement_group([{"GPU": 1}] * bundles, strategy="PACK")
    try:
        await asyncio.wait_for(group.ready(), timeout)
    except asyncio.TimeoutError:
        remove_placement_group(group)
        raise BadRequest(f"could not reserve {bundles} GPU bundles within {timeout:g}s (cluster busy?)") from None
    return group


def split_slots(group: PlacementGroup, count: int) -> list[Slot]:
    return [Slot(group, i, 1.0) for i in range(count)]


def colocated_slots(group: PlacementGroup, count: int, sharers: int) -> list[Slot]:
    # Fractions slightly under 1/sharers so rounding never makes the last sharer miss its bundle.
    return [Slot(group, i, round(0.99 / sharers, 4)) for i in range(count)]
