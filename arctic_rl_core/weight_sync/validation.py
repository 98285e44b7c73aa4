"""Receiver-side check of a sync: the names and shapes it brings must be exactly those the receiver holds.

Loading a partial or misshapen set would leave the sampler with a mix of old
and new weights, or crash halfway through a load; refusing up front, with the
offending names, costs nothing.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from arctic_rl_core.weight_sync.buckets import BucketLayout
from arctic_rl_core.weight_sync.errors import WeightMismatchError

Shapes = Mapping[str, Sequence[int]]

# Enough names to act on without flooding a log for a whole wrong model.
_SHOWN = 8


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > _SHOWN else shown


def mismatch_report(incoming: Shapes, expected: Shapes) -> str | None:
    """What differs between the incoming and expected {name: shape}, or None when they agree."""
    missing = [n for n in expected if n not in incoming]
    unexpected = [n for n in incoming if n not in expected]
    misshapen = [
        f"{n} {list(incoming[n])} (expected {list(expected[n])})"
        for n in incoming
        if n in expected and tuple(incoming[n]) != tuple(expected[n])
    ]
    problems = []
    if missing:
        problems.append(f"missing {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected {_listed(unexpected)}")
    if misshapen:
        problems.append(f"wrong shape {_listed(misshapen)}")
    return "; ".join(problems) or None


def check_shapes(incoming: Shapes, expected: Shapes, *, step: str = "validate") -> None:
    """Raise ``WeightMismatchError`` naming every missing, unexpected or misshapen parameter."""
    report = mismatch_report(incoming, expected)
    if report is not None:
        raise WeightMismatchError(step, f"the receiver refused the weights: {report}")


def layout_shapes(layouts: Iterable[BucketLayout]) -> dict[str, tuple[int, ...]]:
    """{name: shape} over all slots of all buckets; a name in two slots is an error."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layout in layouts:
        for slot in layout.slots:
            if slot.name in shapes:
                raise WeightMismatchError("validate", f"the sender sent {slot.name!r} twice")
            shapes[slot.name] = slot.shape
    return shapes


def module_shapes(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
    """The expected set of a receiver, e.g. ``module_shapes(model.named_parameters())``."""
    return {name: tuple(t.shape) for name, t in named_tensors}
