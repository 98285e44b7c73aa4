"""From per-token losses to this micro-batch's share of the call's loss, and metrics that reduce exactly.

Every mode divides by a count of the *whole* call, so summing the shares of any
split into micro-batches (whole rows each) and ranks gives the same loss and
the same gradients as one big batch:

==========================  ==============================================================
token-mean                  sum of token losses / global_tokens
token-sum                   sum of token losses (Tinker's reduction)
seq-mean-token-sum          sum over sequences of (sum of its token losses) / global_seqs
seq-mean-token-mean         sum over sequences of (mean of its token losses) / global_seqs
seq-mean-token-sum-norm     sum of token losses / (global_seqs * horizon)   (Dr. GRPO)
==========================  ==============================================================

The seq-mean modes assume a sequence is never split across micro-batches.
``global_seqs`` counts the call's sequences with at least one loss token; a
loss config's ``num_sequences`` replaces it, for frameworks that divide by
their mini-batch size, rows whose loss tokens were all masked out included
(verl, SkyRL).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import Field
from torch import Tensor

from arctic_rl_core.processors.base import LossConfig, LossInputs

AggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class AggregatedLossConfig(LossConfig):
    """Config of a loss that reduces per-token values by ``loss_agg_mode``."""

    loss_agg_mode: AggMode = "token-mean"
    num_sequences: Optional[int] = Field(
        None,
        ge=1,
        description="What the seq-mean modes divide by: the framework's mini-batch size (verl's global_batch_size, "
        "SkyRL's mini-batch rows). None: the call's sequences with at least one loss token.",
    )


def _positive(count: float) -> float:
    # A call without a single loss token has all-zero numerators; dividing by 1 keeps the loss 0, not NaN.
    return count if count > 0 else 1.0


def aggregate(values: Tensor, inputs: LossInputs, mode: AggMode, num_sequences: int | None = None) -> Tensor:
    """This micro-batch's share of ``values`` ([B, T] per-token losses) reduced over the call by ``mode``.

    The seq-mean modes divide by ``num_sequences`` when given, else by ``inputs.global_seqs``.
    """
    masked = values * inputs.mask
    seqs = _positive(float(num_sequences) if num_sequences is not None else inputs.global_seqs)
    if mode == "token-mean":
        return masked.sum() / _positive(inputs.global_tokens)
    if mode == "token-sum":
        return masked.sum()
    if mode == "seq-mean-token-sum":
        return masked.sum() / seqs
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / inputs.mask.sum(-1).clamp_min(1.0)
        return per_seq.sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (seqs * inputs.horizon)
    raise ValueError(f"loss_agg_mode={mode!r} is not one of {AggMode.__args__}")


def token_mean_metric(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum, weight) of ``values`` over the loss tokens: reduces to their token-weighted mean."""
    values = values.detach().float()
    return (values * mask).sum(), mask.sum()


def share_metric(share: Tensor, inputs: LossInputs) -> tuple[Tensor, Tensor]:
    """(sum, weight) of a loss share, weighted by this micro-batch's fraction of the call's tokens.

    The weights of all shares add up to 1, so the reduced ``sum / weight`` is the
    sum of the shares: the call's value of that loss term in its own aggregation
    mode, whatever the micro-batch split.
    """
    fraction = inputs.mask.sum() / _positive(inputs.global_tokens)
    return share.detach().float(), fraction


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Largest of ``values`` over the loss tokens; 0 when there is none (the metrics it serves are positive)."""
    values = values.detach().float()
    return torch.where(mask > 0, values, torch.zeros_like(values)).amax() if values.numel() else values.new_zeros(())
