"""The batch contract: which context tensors a loss reads, and their dtype and shape, checked at the edge.

``batch["context"]`` of a fwd_bwd call carries, for a batch of B sequences
padded to T tokens:

=========================  ==============  ==================================================
advantages                 [B] or [B, T]   per sequence, or per token in the shifted layout
old_log_probs_shifted      [B, T]          behaviour policy (the sampler) log-probs
prox_logp_shifted          [B, T]          proximal policy log-probs (decoupled PPO)
ref_log_probs_shifted      [B, T]          reference policy log-probs (KL penalty)
response_mask              [B, T]          unshifted, 1 on response tokens (see masks.py)
loss_mask_shifted          [B, T]          already shifted loss mask (see masks.py)
=========================  ==============  ==================================================

``*_shifted`` tensors follow ``torch.roll(input_ids, -1)``: entry t is about
token t + 1. A key a custom loss adds is [B, T] when it ends in ``_shifted``
and needs a leading dimension B otherwise. Keys no loss reads are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from arctic_rl_core.processors.base import BatchValidationError, LossConfig
from arctic_rl_core.processors.registry import LossSpec

PER_SEQUENCE_OR_TOKEN = "[B] or [B, T]"
PER_TOKEN = "[B, T]"

CONTEXT_LAYOUTS: dict[str, str] = {
    "advantages": PER_SEQUENCE_OR_TOKEN,
    "old_log_probs_shifted": PER_TOKEN,
    "prox_logp_shifted": PER_TOKEN,
    "ref_log_probs_shifted": PER_TOKEN,
    "response_mask": PER_TOKEN,
    "loss_mask_shifted": PER_TOKEN,
}


def layout_of(key: str) -> str:
    if key in CONTEXT_LAYOUTS:
        return CONTEXT_LAYOUTS[key]
    return PER_TOKEN if key.endswith("_shifted") else "[B, ...]"


def _shape_fits(shape: tuple[int, ...], layout: str, batch_shape: tuple[int, int]) -> bool:
    batch, tokens = batch_shape
    if layout == PER_TOKEN:
        return shape == (batch, tokens)
    if layout == PER_SEQUENCE_OR_TOKEN:
        return shape in ((batch,), (batch, tokens))
    return len(shape) >= 1 and shape[0] == batch


def check_context_tensor(key: str, value: object, batch_shape: tuple[int, int], *, floating: bool = True) -> None:
    """Raise :class:`BatchValidationError` naming ``key`` unless ``value`` is a tensor of its layout."""
    layout = layout_of(key)
    expected = f"{layout} with B, T = {batch_shape[0]}, {batch_shape[1]}"
    if not isinstance(value, torch.Tensor):
        raise BatchValidationError(f"context[{key!r}] must be a tensor {expected}, got {type(value).__name__}")
    if floating and not value.dtype.is_floating_point:
        raise BatchValidationError(f"context[{key!r}] must be a floating-point tensor, got dtype {value.dtype}")
    if not _shape_fits(tuple(value.shape), layout, batch_shape):
        raise BatchValidationError(f"context[{key!r}] must have shape {expected}, got {list(value.shape)}")


def validate_batch_context(
    spec: LossSpec, config: LossConfig, context: Mapping[str, object], batch_shape: tuple[int, int]
) -> None:
    """Check, before any forward pass, that ``context`` holds every tensor the configured loss reads.

    Required keys must be present; required and optional keys that are present
    must be floating-point tensors of their layout. The error names the key,
    the expected and the actual shape, so the server can answer 4xx with it.
    """
    required = spec.required_context(config)
    missing = sorted(required - context.keys())
    if missing:
        needs = ", ".join(f"{key!r} ({layout_of(key)})" for key in missing)
        raise BatchValidationError(
            f"loss {spec.name!r} with this config needs context {needs}; the batch context has "
            f"{sorted(context.keys()) or 'no keys'}"
        )
    for key in sorted((required | spec.optional_context(config)) & context.keys()):
        check_context_tensor(key, context[key], batch_shape)
