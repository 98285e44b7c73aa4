"""SkyRL's training batches in arctic-rl's batch contract, and arctic's log-probs back in SkyRL's layout.

SkyRL lays a row out as one left-padded block, ``[pad.. prompt.. response..]``
of width S, and keeps per-response tensors (advantages, loss mask, log-probs)
right-aligned in a ``[B, R]`` window over the last R tokens. arctic's tensors
are ``[B, S]`` in the shifted layout of ``torch.roll(input_ids, -1)``: entry t
is about token t + 1. So response column j (token ``S - R + j``) is shifted
column ``S - R - 1 + j``, and the response window is the shifted columns
``[S - R - 1, S - 1)``.
"""

from __future__ import annotations

from typing import Optional

import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch


def response_columns(sequence_length: int, response_length: int) -> slice:
    """The shifted columns that hold the ``response_length`` right-aligned response tokens."""
    if not 0 < response_length < sequence_length:
        raise ValueError(
            f"response_length must be in [1, {sequence_length - 1}] for sequences of {sequence_length} tokens, "
            f"got {response_length}"
        )
    start = sequence_length - response_length - 1
    return slice(start, start + response_length)


def to_shifted(response: torch.Tensor, sequence_length: int) -> torch.Tensor:
    """A right-aligned ``[B, R]`` response tensor as a ``[B, S]`` shifted one, zero outside the response."""
    rows, response_length = response.shape
    shifted = torch.zeros(rows, sequence_length, dtype=torch.float32)
    shifted[:, response_columns(sequence_length, response_length)] = response.float()
    return shifted


def from_shifted(shifted: torch.Tensor, response_length: int) -> torch.Tensor:
    """The right-aligned ``[B, R]`` response window of a ``[B, S]`` shifted tensor."""
    return shifted[:, response_columns(shifted.shape[1], response_length)]


def model_batch(data: TrainingInputBatch, context: dict[str, torch.Tensor], horizon: Optional[int] = None) -> dict:
    """arctic's ``batch`` for ``data``'s sequences; ``horizon`` right-pads them with masked columns to that width.

    Padding only changes T, which ``seq-mean-token-sum-norm`` divides by; the
    engine drops all-padding columns before its forward pass.
    """
    sequences = data["sequences"].long()
    attention_mask = data["attention_mask"].long()
    width = sequences.shape[1]
    if horizon is not None:
        if width > horizon:
            raise ValueError(
                f"trainer.algorithm.max_seq_len={horizon} is shorter than this batch's sequences ({width} tokens); "
                "seq_mean_token_sum_norm needs max_seq_len >= prompt + response length"
            )
        extra = horizon - width
        sequences = torch.nn.functional.pad(sequences, (0, extra))
        attention_mask = torch.nn.functional.pad(attention_mask, (0, extra))
        context = {k: torch.nn.functional.pad(v, (0, extra)) if v.dim() == 2 else v for k, v in context.items()}
    return {"args": [sequences], "kwargs": {"attention_mask": attention_mask}, "context": context}


def training_context(data: TrainingInputBatch, reference: bool, rollout_correction: bool) -> dict[str, torch.Tensor]:
    """The RL tensors of one policy mini-batch, shifted: advantages, loss mask, and the log-probs the loss reads.

    With rollout correction (token TIS) the recomputed log-probs are arctic's
    proximal policy and the sampler's are its behaviour policy.
    """
    width = data["sequences"].shape[1]
    context = {
        "advantages": to_shifted(data["advantages"], width),
        "loss_mask_shifted": to_shifted(data["loss_mask"], width),
    }
    old = data.get("action_log_probs")
    if rollout_correction:
        context["prox_logp_shifted"] = to_shifted(old, width)
        context["old_log_probs_shifted"] = to_shifted(data["rollout_logprobs"], width)
    elif old is not None:
        context["old_log_probs_shifted"] = to_shifted(old, width)
    if reference:
        context["ref_log_probs_shifted"] = to_shifted(data["base_action_log_probs"], width)
    return context
