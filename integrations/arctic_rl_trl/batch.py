"""TRL's rollout tensors in the arctic batch layout, and back.

TRL keeps prompts left-padded [B, P] and completions right-padded [B, C], and
aligns every per-token quantity (log-probs, masks, importance weights) with
the completion tokens. The arctic engines take the concatenated rows
[B, T = P + C] and per-token tensors in the shifted layout of
``torch.roll(input_ids, -1)``: entry t is about token t + 1, so completion
token j (column P + j) lives at shifted column P + j - 1.

Positions: TRL's forward numbers left-padded rows from the first pad, the
engines from the first real token; rotary attention depends only on position
differences, so both give the same log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def completion_to_shifted(values: torch.Tensor, total_length: int) -> torch.Tensor:
    """[B, C] completion-aligned values -> [B, T] shifted layout, zero before the completion and in the last column."""
    rows, completion_length = values.shape
    out = values.new_zeros(rows, total_length)
    start = total_length - completion_length - 1
    out[:, start : start + completion_length] = values
    return out


def shifted_to_completion(values: torch.Tensor, completion_length: int) -> torch.Tensor:
    """[B, T] shifted layout -> [B, C] values of the completion tokens."""
    total_length = values.shape[1]
    start = total_length - completion_length - 1
    return values[:, start : start + completion_length]


@dataclass
class Rows:
    """Prompt + completion rows of one TRL batch, with the completion length to map back."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    completion_length: int

    @classmethod
    def from_completions(cls, prompt_ids, prompt_mask, completion_ids, completion_mask) -> "Rows":
        return cls(
            torch.cat([prompt_ids, completion_ids], dim=1).cpu(),
            torch.cat([prompt_mask, completion_mask], dim=1).cpu(),
            completion_ids.shape[1],
        )

    @classmethod
    def from_sequences(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int) -> "Rows":
        return cls(input_ids.cpu(), attention_mask.cpu(), completion_length)

    @property
    def total_length(self) -> int:
        return self.input_ids.shape[1]

    def shifted(self, completion_values: torch.Tensor) -> torch.Tensor:
        return completion_to_shifted(completion_values.detach().float().cpu(), self.total_length)

    def model_batch(self, context: dict[str, torch.Tensor] | None = None) -> dict:
        """The ``batch`` argument of fwd_bwd / fwd_no_grad."""
        batch = {"args": [self.input_ids], "kwargs": {"attention_mask": self.attention_mask}}
        if context is not None:
            batch["context"] = context
        return batch


def prompt_grouped_order(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """A row order that puts identical prompts next to each other.

    TRL shuffles a generation batch before splitting it into steps; the loss is
    a sum over rows, so reordering is free, and keeping each prompt's group
    together lets ZoRRo Train compute the shared prompt once per micro-batch.
    """
    keys = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
    return torch.tensor(sorted(range(len(keys)), key=keys.__getitem__), dtype=torch.long)
