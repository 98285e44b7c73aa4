"""The loss interface: what the training engine hands a loss, and what it gets back.

A loss sees one micro-batch at a time, but its result must not depend on how
the engine split the call into micro-batches or ranks. So every loss divides by
the *global* counts carried in :class:`LossInputs` (``global_tokens``,
``global_seqs``, ``horizon``), never by local ones: the engine sums the
micro-batch shares (``LossOutput.loss``) and their gradients over micro-batches
and data-parallel ranks, and that sum is the loss of the whole call.

Every tensor is in the shifted layout of ``torch.roll(input_ids, -1)``: entry
``t`` belongs to the prediction of token ``t + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import Tensor


class ProcessingError(ValueError):
    """A request named a loss, config, post-processor or batch the server cannot run (the server answers 4xx)."""


class UnknownLossError(ProcessingError):
    """``loss_fn`` names no registered loss and no allowed dotted path."""


class LossConfigError(ProcessingError):
    """``processing["config"]`` does not fit the loss's config model."""


class BatchValidationError(ProcessingError):
    """``batch["context"]`` lacks a key the loss needs, or a tensor has the wrong dtype or shape."""


class PostProcessingError(ProcessingError):
    """``processing["post"]`` names an unknown post-processor or gives it a bad config."""


def describe_validation_error(err: ValidationError) -> str:
    """One line per bad field: its name, what was expected, and the value given."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or '<config>'}: {e['msg']} (got {e['input']!r})" for e in err.errors()
    )


class LossConfig(BaseModel):
    """Base of every loss's config model: unknown keys are errors, and the config says what the loss reads.

    ``required_context`` and ``optional_context`` depend on the config (a KL
    coefficient above zero makes the reference log-probs required), so they
    are methods of the parsed config, not constants of the loss.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def required_context(self) -> frozenset[str]:
        """Context keys the loss cannot run without."""
        return frozenset()

    def optional_context(self) -> frozenset[str]:
        """Context keys the loss uses when present (validated for dtype and shape when given)."""
        return frozenset()

    def needs_entropy(self) -> bool:
        """Whether the engine must compute the policy's entropy at the loss tokens."""
        return False


@dataclass
class LossInputs:
    """One micro-batch as a loss sees it, with the denominators of the whole fwd_bwd call.

    ``logprobs[b, t]`` is log p(input_ids[b, t + 1] | input_ids[b, :t + 1]) under
    the current policy; it requires grad and is 0 where ``mask`` is 0.
    ``context`` holds the validated RL tensors: ``advantages`` ([B] or [B, T])
    and the ``*_shifted`` log-probs ([B, T]).
    """

    logprobs: Tensor
    mask: Tensor
    context: dict[str, Tensor]
    entropy: Tensor | None
    global_tokens: float  # mask.sum() over all micro-batches and data-parallel ranks of the call
    global_seqs: float  # sequences with at least one loss token in the whole call
    horizon: int  # T of the call's padded batch: the Dr. GRPO normalizer of seq-mean-token-sum-norm

    def has(self, key: str) -> bool:
        return key in self.context

    def per_token(self, key: str) -> Tensor:
        """Context tensor ``key`` as [B, T] float32, with [B] broadcast over tokens and masked-out entries zeroed.

        The servers refuse non-finite context values before a batch reaches a
        rank; zeroing is the second line: a -inf or NaN in a padded position
        would otherwise poison the loss and every gradient, as ``0 * nan``.
        """
        value = self.context[key].to(device=self.logprobs.device, dtype=torch.float32)
        if value.dim() == 1:
            value = value.unsqueeze(-1).expand_as(self.logprobs)
        return torch.where(self.mask > 0, value, torch.zeros_like(value))


@dataclass
class LossOutput:
    """This micro-batch's share of the loss, and its metrics in a form that reduces exactly across shares.

    ``metrics[name] = (sum, weight)``: the engine sums both over micro-batches
    and ranks and reports ``sum / weight`` (a token-weighted mean).
    ``maxima[name]`` is reduced by max.
    """

    loss: Tensor
    metrics: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    maxima: dict[str, Tensor] = field(default_factory=dict)
